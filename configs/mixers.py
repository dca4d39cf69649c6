"""Token mixers compared: softmax vs DeltaNet vs GDN vs KDA vs GDN-2 (docs/MATH.md §6.3, §6.7 F1).

    python -m experiments.compare --config=configs/mixers.py:tiny --workdir=runs/mixers_tiny
    python -m experiments.train --config=configs/mixers.py:small --config.arm=kda --workdir=...

* tiny: pure 2-layer stacks of each mixer (softmax = a 2-layer Transformer++), AdamW.
* small: 8 layers, the 2:1 linear:softmax hybrid (linear_attention_freq 3) for every linear
  mixer, pure softmax as the reference, AdamW.
* paper: the controlled 20-layer 2:1 grid of docs/MATH.md §6.3 (softmax: the 24-layer
  Transformer++), AdamW 3e-4 (the GDN-2 launchers' default; `configs/optimizers.py` crosses with
  Muon). Its models are built with `model.scan_layers=True`: a scan over the layer period,
  the same function and initial parameters, bit for bit on CPU, and a cheaper train-step
  compile (CPU lower+compile: softmax -54 %, the hybrids -1 % (DeltaNet) to -39 % (KDA);
  docs/BENCHMARKS.md, "The train step's compile and a scan over layers");
  `--config.model.scan_layers=false` restores the unrolled stack (and its checkpoint layout).
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
    if size == "paper":
      config.model.scan_layers = True
    config.arms = base.arms({mixer: base.mixer_overrides(mixer, size) for mixer in MIXERS})
  return config
