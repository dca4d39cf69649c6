"""Optimisers compared: AdamW vs Muon (+ Adam on non-matrix parameters), on GDN (the base
stack of each size) and on softmax attention (docs/MATH.md §6.5, §6.7 F4).

    python -m experiments.compare --config=configs/optimizers.py:tiny --workdir=runs/optim_tiny
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
  size = size or "tiny"
  with config.unlocked():
    config.name = f"optimizers_{size}"
    adamw = {"optim": {"name": "adamw"}}
    muon = {"optim": dict(base.MUON[size])}
    config.arms = base.arms({
        f"{mixer}_{name}": base.merge(base.mixer_overrides(mixer, size), opt)
        for mixer in ("gdn", "softmax") for name, opt in (("adamw", adamw), ("muon", muon))
    })
  return config
