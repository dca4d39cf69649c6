"""Token mixers compared: softmax vs DeltaNet vs GDN vs KDA vs GDN-2 (docs/MATH.md §6.3, §6.7 F1).

    python -m experiments.compare --config=configs/mixers.py:tiny --workdir=runs/mixers_tiny
    python -m experiments.train --config=configs/mixers.py:small --config.arm=kda --workdir=...

* tiny: pure 2-layer stacks of each mixer (softmax = a 2-layer Transformer++), AdamW.
* small: 8 layers, the 2:1 linear:softmax hybrid (linear_attention_freq 3) for every linear
  mixer, pure softmax as the reference, AdamW.
* paper: the controlled 20-layer 2:1 grid of docs/MATH.md §6.3 (softmax: the 24-layer
  Transformer++), AdamW 3e-4 (the GDN-2 launchers' default; `configs/optimizers.py` crosses with
  Muon). `--config.model.scan_layers=true` builds the stack as a scan over its layer period
  (a cheaper train-step compile, but on an H200 the scanned softmax model trains 15 % slower
  and the scanned GDN-2 hybrid runs out of memory at 16 x 4096: docs/BENCHMARKS.md, "The train
  step's compile and a scan over layers"), so the comparison keeps the unrolled stack.
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

MIXERS = ("softmax", "deltanet", "gdn", "kda", "gdn2")


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  config = base.get_config(size)
  with config.unlocked():
    config.name = f"mixers_{size or 'tiny'}"
    if size == "small":
      config.model.linear_attention_freq = 3
    config.arms = base.arms({mixer: base.mixer_overrides(mixer, size) for mixer in MIXERS})
  return config
