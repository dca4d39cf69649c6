"""Cross-layer routing compared: GDN and DeltaNet, each without routing and with CLER (v1),
CLER-H and CLVR (docs/MATH.md §5, §6.7 Table A, F5, F6).

As in Table A: the 2:1 hybrid, Muon. The tiny model has 3 layers (LLS), so CLER v1 routes
between the two linear layers.

    python -m experiments.compare --config=configs/routing.py:tiny --workdir=runs/routing_tiny
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

ROUTINGS = {"": None, "_cler": "cler", "_cler_h": "cler_h", "_clvr": "clvr"}
# docs/MATH.md §6.7 Table A: final validation loss at iteration 28,610 (350M, 2:1, Muon, 15B
# tokens).
# CLER v1 runs are not in the table.
TABLE_A = {"gdn": 2.341689, "gdn_clvr": 2.335839, "gdn_cler_h": 2.337488,
           "deltanet": 2.334680, "deltanet_clvr": 2.333069, "deltanet_cler_h": 2.334493}


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  config = base.get_config(size)
  size = size or "tiny"
  with config.unlocked():
    config.name = f"routing_{size}"
    config.model.linear_attention_freq = 3
    if size == "tiny":
      config.model.n_layers = 3
    config.optim.update(base.MUON[size])
    config.arms = base.arms({
        f"{mixer}{suffix}": base.merge(base.mixer_overrides(mixer, size),
                                       {"model": {"routing": routing}})
        for mixer in ("gdn", "deltanet") for suffix, routing in ROUTINGS.items()
    })
    if size == "paper":
      config.paper = TABLE_A
  return config
