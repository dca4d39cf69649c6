"""Hybrid stacks compared: pure GDN vs 2:1 vs 3:1 linear:softmax, with pure softmax as the
reference (docs/MATH.md §6.2, §6.7 F3).

The stacks follow the repo's rule on a fixed depth: layer i is softmax iff (i + 1) mod N == 0,
N = 3 ("2:1") or N = 4 ("3:1"). On the tiny 6-layer model that is LLSLLS and LLLSLL.

    python -m experiments.compare --config=configs/hybrids.py:tiny --workdir=runs/hybrids_tiny
"""

from __future__ import annotations

import ml_collections

try:
  from configs import base
except ImportError:  # loaded by path from another working directory
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from configs import base


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  config = base.get_config(size)
  with config.unlocked():
    config.name = f"hybrids_{size or 'tiny'}"
    if size in ("tiny", "", None):
      config.model.n_layers = 6
    config.arms = base.arms({
        "pure": {"model": {"linear_attention_freq": None}},
        "hybrid_2to1": {"model": {"linear_attention_freq": 3}},
        "hybrid_3to1": {"model": {"linear_attention_freq": 4}},
        "softmax": base.mixer_overrides("softmax", size),
    })
  return config
