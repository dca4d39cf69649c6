# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Cross-layer routing: what CLER and CLVR learn
#
# Two small GDN hybrids with routing (docs/MATH.md §5) are trained briefly on the embedded corpus:
#
# * **CLER v1** adds γ_ℓ · r^{(ℓ−1)} (the previous linear layer's write residual) to each linear
#   layer's value target; γ starts at 0, so the model starts as the baseline.
# * **CLVR** adds P_ℓ(v^{(ℓ)}) (the layer's own write value, projected to d) to the hidden stream
#   after the block; P_ℓ starts at 0.
#
# `lineax_attn.inspect.routing_summary` reads the routing parameters per layer: how far γ moved
# from 0, how large P_ℓ grew and which value heads it reads.
#
# `LINEAX_NOTEBOOK_FAST` (default `1`): tiny sizes, seconds on a CPU; `0`: bigger and longer.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from lineax_attn import inspect as li
from lineax_attn.models import ModelConfig

FAST = os.environ.get("LINEAX_NOTEBOOK_FAST", "1") != "0"
STEPS = 60 if FAST else 2000
base = ModelConfig(
    vocab_size=384, mixer="gdn", pattern="LLS", n_layers=3 if FAST else 6,
    d_model=32 if FAST else 128, num_heads=2, num_v_heads=4, head_dim_k=8 if FAST else 32,
    attn_heads=2, mlp_hidden=64 if FAST else 384, chunk_size=16,
    implementation="scan" if FAST else None)  # the scan compiles fastest for tiny runs

# %% [markdown]
# ## Train both

# %%
runs = {}
for mode, extra in (("cler", dict(cler_gamma="head")), ("clvr", {})):
  config = base.replace(routing=mode, **extra)
  runs[mode] = li.train_tiny(config, steps=STEPS, batch_size=8, seq_len=64 if FAST else 256)
plt.figure(figsize=(5, 2.8))
for mode, (_, losses) in runs.items():
  plt.plot(np.convolve(losses, np.ones(5) / 5, mode="valid"), label=mode)
plt.xlabel("step")
plt.ylabel("training loss (5-step mean)")
plt.legend()
plt.show()

# %% [markdown]
# ## CLER v1: the injection gains γ per layer and value head
#
# The first linear layer receives γ·0 (no earlier residual), so its γ never moves; the later
# ones learn how much of the lower layer's write error to add to their value targets.

# %%
cler = li.routing_summary(runs["cler"][0])
for entry in cler:
  print(f"layer {entry['layer']} ({entry['kind']}): γ per head = "
        f"{np.round(entry['gamma'].ravel(), 4).tolist()}")
fig, ax = plt.subplots(figsize=(5, 2.8))
width = 0.8 / len(cler)
for i, entry in enumerate(cler):
  gamma = entry["gamma"].ravel()
  ax.bar(np.arange(gamma.size) + i * width, gamma, width, label=f"layer {entry['layer']}")
ax.axhline(0, color="black", lw=0.5)
ax.set_xlabel("value head")
ax.set_ylabel("γ")
ax.legend()
plt.show()

# %% [markdown]
# ## CLVR: the projections P_ℓ
#
# ‖P_ℓ‖_F per layer, and the norm of the rows of P_ℓ that read each value head: which heads'
# write values each layer routes into the residual stream.

# %%
clvr = li.routing_summary(runs["clvr"][0])
fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
axes[0].bar([str(e["layer"]) for e in clvr], [e["proj_norm"] for e in clvr])
axes[0].set_xlabel("layer")
axes[0].set_title("‖P_ℓ‖_F")
heads = np.stack([e["head_norms"] for e in clvr])
image = axes[1].imshow(heads, cmap="viridis", aspect="auto")
axes[1].set_yticks(range(len(clvr)), [f"layer {e['layer']}" for e in clvr])
axes[1].set_xlabel("value head")
axes[1].set_title("norm of P_ℓ's rows per head")
fig.colorbar(image, ax=axes[1])
plt.show()
