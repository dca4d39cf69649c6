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
# # DeltaNet, GDN, KDA and GDN-2 side by side
#
# Each mixer is trained on multi-query associative recall (MQAR, docs/MATH.md §7.1: key-value pairs,
# then queries of the keys; the model must answer each query with its value) with
# `lineax_attn.evals.recall`. Then one MQAR example goes through each trained model while
# `lineax_attn.inspect.capture` records the gates and states: how strongly each mixer decays
# (α = exp(g): none for DeltaNet, one scalar per head for GDN, per key channel for KDA and GDN-2),
# how hard it writes (β, or GDN-2's erase b and write w), and whether the state still returns the
# stored values at the query positions. Last, recall accuracy as the number of pairs grows.
#
# `LINEAX_NOTEBOOK_FAST` (default `1`): tiny sizes, seconds on a CPU; `0`: bigger and longer.

# %%
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from lineax_attn import inspect as li
from lineax_attn.data import synthetic
from lineax_attn.evals import recall

FAST = os.environ.get("LINEAX_NOTEBOOK_FAST", "1") != "0"
# Fast mode trains DeltaNet (no decay; β) and GDN-2 (per-channel decay; erase b, write w): they
# take every branch of the cells below, GDN and KDA would only add compiles.
MIXERS = ("deltanet", "gdn2") if FAST else ("deltanet", "gdn", "kda", "gdn2")
SEQ_LEN, VOCAB = (32, 64) if FAST else (128, 256)
NUM_PAIRS = (2, 8) if FAST else (4, 8, 16, 32)
D_MODEL = 32 if FAST else 128
SETTINGS = recall.TrainSettings(steps=20 if FAST else 2000, batch_size=16 if FAST else 64,
                                steps_per_call=20 if FAST else 25)
# Fast mode: one layer and the scan (quickest to compile), few steps: it checks that the code
# runs, and its accuracies stay near chance; LINEAX_NOTEBOOK_FAST=0 trains for real.
OVERRIDES = dict(chunk_size=16, n_layers=1, implementation="scan") if FAST else {}
# MQAR's blocks (configs/mqar.py): no output gate, decays that start with a long memory; with the
# LM's output gates and FLA's gate init the gated mixers stay at chance for thousands of steps
# (docs/EXPERIMENTS.md, "MQAR sweeps").
OVERRIDES.update(output_gate="none", gate_init="long")
LR = 3e-3

# %% [markdown]
# ## Recall accuracy vs number of pairs
#
# One model per (mixer, number of pairs), as in the MQAR protocol (`recall.sweep_mqar` runs the
# full grid with a learning-rate sweep); accuracy on held-out examples (another seed). Every
# mixer's state holds d_k·d_v·H_v numbers per layer; recall fails once the pairs no longer fit.
# The model trained at the largest N is kept for the rest of the notebook.

# %%
accuracy, models = {}, {}
for mixer in MIXERS:
  config = recall.sweep_model_config(mixer, D_MODEL, VOCAB, **OVERRIDES)
  for n in NUM_PAIRS:
    task = synthetic.MQARConfig(vocab=VOCAB, seq_len=SEQ_LEN, num_pairs=n)
    run = recall.train_mqar_lrs(config, task, [LR], SETTINGS)  # one compile per mixer
    test = synthetic.mqar(VOCAB, SEQ_LEN, n, count=128 if FAST else 3000, seed=1)
    accuracy[mixer, n] = run.accuracies(*test)[0]
    models[mixer] = run.models[0]
  print(f"{mixer:>9}: " + ", ".join(f"N={n}: {accuracy[mixer, n]:.2f}" for n in NUM_PAIRS))
plt.figure(figsize=(5, 3))
for mixer in MIXERS:
  plt.plot(NUM_PAIRS, [accuracy[mixer, n] for n in NUM_PAIRS], marker="o", label=mixer)
plt.xscale("log", base=2)
plt.xlabel("key-value pairs N")
plt.ylabel("MQAR accuracy")
plt.title(f"T={SEQ_LEN}, d={D_MODEL}, state {recall.state_size(config, SEQ_LEN)} per layer")
plt.legend()
plt.show()

# %% [markdown]
# ## One example through each trained model
#
# A held-out example with the largest N, captured in every model.

# %%
task = synthetic.MQARConfig(vocab=VOCAB, seq_len=SEQ_LEN, num_pairs=NUM_PAIRS[-1])
inputs, labels = synthetic.mqar(VOCAB, SEQ_LEN, task.num_pairs, count=1, seed=123)
captures = {mixer: li.capture(model, jnp.asarray(inputs)) for mixer, model in models.items()}
queries = np.flatnonzero(labels[0] != synthetic.IGNORE)
print("query positions:", queries.tolist())

# %% [markdown]
# Decay α = exp(g) in the first layer, averaged over heads (and key channels): DeltaNet never
# decays; the gated mixers can forget quickly between the pairs and hold on through the
# queries.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3))
for mixer, result in captures.items():
  cap = result.layers[0]
  alpha = np.ones(SEQ_LEN) if cap.decay is None else np.asarray(cap.decay[0]).reshape(SEQ_LEN, -1)
  alpha = alpha.mean(axis=-1) if alpha.ndim == 2 else alpha
  axes[0].plot(alpha, label=mixer)
  write = cap.gates.get("beta", cap.gates.get("w"))
  axes[1].plot(np.asarray(write[0]).reshape(SEQ_LEN, -1).mean(axis=-1), label=mixer)
for ax, title in zip(axes, ("decay α (mean over heads, channels)",
                            "write strength β (GDN-2: w), mean")):
  ax.axvline(2 * task.num_pairs - 0.5, color="gray", ls=":")  # pairs | queries
  ax.set_title(title, fontsize=9)
  ax.set_xlabel("token t")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# How fast each forgets: the forgetting curve exp(Σ g) of the first layer (mean over heads) and
# the half-life at the mean decay rate.

# %%
plt.figure(figsize=(5, 3))
for mixer, result in captures.items():
  cap = result.layers[0]
  if "g" not in cap.gates:
    plt.plot(np.ones(SEQ_LEN), label=f"{mixer} (no decay)")
    continue
  curve = np.asarray(li.forgetting_curve(cap.gates["g"]))[0].mean(axis=-1)
  half = np.asarray(li.half_life(cap.gates["g"]))[0]
  plt.plot(curve, label=f"{mixer} (half-life {np.median(half):.1f} tokens)")
plt.yscale("log")
plt.xlabel("token t")
plt.title("forgetting curve, layer 0")
plt.legend(fontsize=8)
plt.show()

# %% [markdown]
# Memory readout at the end of the sequence: for each key position j, cos(S_Tᵀ k_j, v_j) in the
# first layer, averaged over heads — does the final state still return what each token wrote?

# %%
plt.figure(figsize=(6, 3))
for mixer, result in captures.items():
  cap = result.layers[0]
  readout = np.asarray(li.memory_readout(cap.states, cap.k, cap.v))[0]  # [HV, T, T]
  plt.plot(np.nanmean(readout[:, -1, :], axis=0), marker=".", label=mixer)
plt.axvline(2 * task.num_pairs - 0.5, color="gray", ls=":")
plt.xlabel("written at token j")
plt.ylabel("cos(S_Tᵀ k_j, v_j)")
plt.legend(fontsize=8)
plt.show()

# %% [markdown]
# The last layer's states at the end of the pairs and at the end of the sequence, head 0.

# %%
fig, axes = plt.subplots(2, len(MIXERS), figsize=(2.4 * len(MIXERS), 4.6))
for col, (mixer, result) in enumerate(captures.items()):
  cap = result.layers[max(result.layers)]
  for row, t in enumerate((2 * task.num_pairs - 1, SEQ_LEN - 1)):
    state = np.asarray(cap.states[0, t, 0])
    lim = np.abs(state).max() or 1.0
    axes[row, col].imshow(state, cmap="RdBu_r", vmin=-lim, vmax=lim)
    axes[row, col].set_xticks([])
    axes[row, col].set_yticks([])
    axes[row, col].set_title(f"{mixer}, t={t}", fontsize=8)
plt.show()
