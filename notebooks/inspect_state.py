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
# # Inside the recurrent state
#
# A small Gated DeltaNet hybrid is trained for a moment on the embedded Shakespeare corpus (or
# loaded from an `experiments/train.py` run), then one prompt is run through it while
# `lineax_attn.inspect.capture` records, for every linear layer, the q, k, v and gates it used
# and the state S_t after every token (docs/MATH.md §2: S_t = Diag(α_t)(I − β_t k_t k_tᵀ)… in float32).
#
# Environment variables:
# * `LINEAX_NOTEBOOK_FAST` (default `1`): tiny sizes so the notebook runs in seconds on a CPU;
#   `0` trains a bigger model for longer.
# * `LINEAX_NOTEBOOK_CHECKPOINT`: a workdir of `experiments/train.py`; its latest checkpoint is
#   inspected instead of training here.

# %%
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from lineax_attn import inspect as li
from lineax_attn.data import tokenizers
from lineax_attn.models import ModelConfig

FAST = os.environ.get("LINEAX_NOTEBOOK_FAST", "1") != "0"
CHECKPOINT = os.environ.get("LINEAX_NOTEBOOK_CHECKPOINT")

# %% [markdown]
# ## A model to look at

# %%
if CHECKPOINT:
  model, experiment = li.load_model(CHECKPOINT)
  config = experiment.model
  tokenizer = tokenizers.get_tokenizer(experiment.train_data.tokenizer)
  print(f"loaded {experiment.run_name} from {CHECKPOINT}")
else:
  config = ModelConfig(
      vocab_size=384, mixer="gdn", pattern="LS", n_layers=2 if FAST else 6,
      d_model=32 if FAST else 128, num_heads=2, head_dim_k=16 if FAST else 32, attn_heads=2,
      mlp_hidden=64 if FAST else 384, chunk_size=16,
      implementation="scan" if FAST else None)  # the scan compiles fastest for tiny runs
  tokenizer = tokenizers.ByteTokenizer()
  model, losses = li.train_tiny(config, steps=100 if FAST else 2000, batch_size=8,
                                seq_len=64 if FAST else 256)
  plt.figure(figsize=(5, 2.5))
  plt.plot(losses)
  plt.xlabel("step")
  plt.ylabel("training loss (nats/byte)")
  plt.show()
print("layers:", config.layer_types)

# %% [markdown]
# ## One prompt, captured

# %%
prompt = "ROMEO. But soft, what light through yonder window breaks? It is the east"
tokens = jnp.asarray(tokenizer.encode(prompt)[None, :48 if FAST else 96])
result = li.capture(model, tokens)
for i, cap in result.layers.items():
  print(f"layer {i} ({cap.kind}): q {cap.q.shape}, v {cap.v.shape}, states {cap.states.shape}, "
        f"gates {sorted(cap.gates)}")
layer = min(result.layers)
cap = result.layers[layer]

# %% [markdown]
# The state of every value head at a few tokens (rows: heads; each panel is S_t, keys down,
# values across).

# %%
fig = li.plot_state_heatmaps(cap.states, title=f"layer {layer} ({cap.kind}) states S_t")
plt.show()

# %% [markdown]
# How big the state is and how many directions it uses: ‖S_t‖_F and the effective rank
# (exp of the entropy of the normalised singular values; at most d_k).

# %%
norms = np.asarray(li.state_norms(cap.states))[0]      # [T, HV]
ranks = np.asarray(li.effective_rank(cap.states))[0]   # [T, HV]
fig, axes = plt.subplots(1, 2, figsize=(9, 2.8))
for h in range(norms.shape[1]):
  axes[0].plot(norms[:, h], label=f"head {h}")
  axes[1].plot(ranks[:, h], label=f"head {h}")
axes[0].set_title("state norm ‖S_t‖_F")
axes[1].set_title("effective rank of S_t")
for ax in axes:
  ax.set_xlabel("token t")
axes[0].legend(fontsize=7)
plt.show()

# %% [markdown]
# The gates along the prompt: the decay α_t = exp(g_t) (how much of the old state survives each
# token) and the write strength β_t; and the forgetting curve Π α (what is left of the state
# before the prompt).

# %%
fig = li.plot_gates(cap)
plt.show()
if "g" in cap.gates:
  curve = np.asarray(li.forgetting_curve(cap.gates["g"]))[0]
  plt.figure(figsize=(5, 2.5))
  plt.semilogy(curve)
  plt.title("forgetting curve exp(Σ g) per head")
  plt.xlabel("token t")
  plt.show()
  print("half-life per head (tokens):", np.round(np.asarray(li.half_life(cap.gates["g"]))[0], 1))

# %% [markdown]
# Memory readout: cos(S_tᵀ k_j, v_j), how well the state at token t still returns the value
# written by token j (1 on the diagonal for a fresh write; fades as the state decays and is
# overwritten).

# %%
readout = li.memory_readout(cap.states, cap.k, cap.v)
fig = li.plot_readout(readout, title=f"layer {layer} memory readout")
plt.show()
lag_mean = [np.nanmean(np.diagonal(np.asarray(readout)[0], offset=-lag, axis1=1, axis2=2))
            for lag in range(tokens.shape[1])]
print("mean readout by lag 0, 1, 2, 4, 8, 16:", np.round([lag_mean[i] for i in
                                                           (0, 1, 2, 4, 8, 16)], 3))
