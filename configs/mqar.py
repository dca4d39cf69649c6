"""MQAR sweeps (docs/MATH.md §7.1) and NIAH settings (§7.2) for `experiments/eval_recall.py`.

    python -m experiments.eval_recall --config=configs/mqar.py:cpu --workdir=runs/mqar_cpu
    python -m experiments.eval_recall --config=configs/mqar.py:gpu --workdir=runs/mqar_gpu
    python -m experiments.eval_recall --config=configs/mqar.py:cpu --checkpoint=runs/base \
        --workdir=runs/niah                                          # NIAH of a trained LM

Sizes:

* `cpu`: all six mixers, 2 layers, d_model 64, V 128, T 64, N in {4, 8, 16}, one LR (1e-2),
  100 steps of 32 examples; the linear mixers run their `lax.scan` form (at T = 64 it compiles
  and runs faster on a CPU than the chunked form). A smoke run of the whole program: the numbers
  are far from converged (MQAR has a long plateau before the linear mixers pick it up).
* `gpu`: V 8192, T 128, N in {8, 16, 32}, d_model 128, LRs {3e-4, 1e-3, 3e-3} trained
  together (vmapped), 3,000 steps of 64 examples, chunked pure-JAX mixers in bf16
  (`implementation="chunk"`: the vmapped loop should not depend on the Pallas kernels), XLA
  softmax attention. About 9 minutes on one H200 with the 6 compiles (measured: a cell of
  3,000 steps x 3 LRs takes 18-45 s after compiling); the `max_minutes` guard (9, under the
  10-minute command limit) stops the sweep cleanly and writes the finished cells; cells run in
  the order T, N, d_model, mixer. The classic wider grid: `'--config.seq_lens=(128,256,512)'
  '--config.num_pairs=(8,16,32,64)' '--config.d_models=(64,128)'` (about 30 minutes per 1000
  steps on one H200, estimated). Results: docs/EXPERIMENTS.md.

Both sizes use Zoology's blocks (no output gate) and `gate_init="long"` for every mixer: MQAR
measures the state update, and with the LM's output gates and FLA's gate init the gated mixers
stay at chance for thousands of steps (docs/EXPERIMENTS.md, "MQAR sweeps"). Where keys wait
long for their queries `long` is too short: at T 512 (N 64: GDN, KDA and GDN-2 at chance after
6,000 steps) and at T 256 N 64 (0.53 / 0.51 / 0.0006 after 8,000); `very_long` gives them
0.94-0.9997 there. The whole grid (docs/EXPERIMENTS.md, "The whole MQAR grid") ran `long` at
T <= 256 and `--config.model.gate_init=very_long` at T 512.

`max_minutes` (None = no limit) applies to the MQAR sweep; `stop_loss` (None = every step) ends
a run once its training loss is below it (the grid used 1e-3); `niah` is used with
`--checkpoint`.
"""

from __future__ import annotations

import ml_collections

MIXERS = ("softmax", "linear_attention", "deltanet", "gdn", "kda", "gdn2")
SIZES = ("cpu", "gpu")


def _niah() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      tasks=("s_niah_1", "s_niah_2", "s_niah_3", "mk_niah_1"),
      lengths=(1024, 2048, 4096, 8192),
      num_depths=5,
      samples_per_depth=2,
      max_new_tokens=48,          # a UUID is 36 characters (byte tokens)
      batch_size=8,
      template="ruler",           # or "short" (a one-line question)
      seed=0,
  ))


def get_config(size: str = "cpu") -> ml_collections.ConfigDict:
  size = size or "cpu"
  if size not in SIZES:
    raise ValueError(f"Unknown config size {size!r}; expected one of {SIZES}")
  c = ml_collections.ConfigDict()
  c.name = f"mqar_{size}"
  c.mixers = MIXERS
  c.power = 0.01
  c.seed = 0
  c.test_examples = 3000
  c.train_examples = 100_000
  c.warmup_fraction = 0.1
  c.weight_decay = 0.1
  c.steps_per_call = 25
  c.vmap_lrs = True
  c.max_minutes = ml_collections.config_dict.placeholder(float)
  # Stop a run once its training loss is below this (None: every step; `TrainSettings`).
  c.stop_loss = ml_collections.config_dict.placeholder(float)
  # ModelConfig overrides for every mixer (2 layers of mixer + SwiGLU).
  c.model = ml_collections.ConfigDict(dict(
      n_layers=2, num_heads=2, attn_heads=2, chunk_size=64, implementation="chunk",
      attn_implementation="xla", dtype="float32", param_dtype="float32",
      # MQAR tests the state-update rule, so the blocks are Zoology's (mixer + MLP, no output
      # gate) and the decays start with a long memory. Measured on CPU (V 128, T 128, N 4,
      # d 64, 300 steps, lr 3e-3, scan): DeltaNet 0.97 accuracy, DeltaNet + SiLU output gate
      # 0.16; GDN with FLA's gate init 0.04, without output gate 0.14, and with
      # gate_init="long" and no output gate 0.96 (KDA 0.80). The first H200 sweep with FLA's
      # init and the default output gates left GDN, KDA and GDN-2 at chance after 3,000 steps
      # while DeltaNet reached 1.0; with these two settings GDN reached 1.0 at N = 8
      # (docs/EXPERIMENTS.md).
      output_gate="none", gate_init="long"))
  if size == "cpu":
    c.vocab = 128
    c.seq_lens = (64,)
    c.num_pairs = (4, 8, 16)
    c.d_models = (64,)
    c.lrs = (1e-2,)                   # the fastest-learning LR in a short CPU run
    c.steps, c.batch_size = 100, 32
    c.test_examples = 512
    c.model.implementation = "scan"   # T = 64 on a CPU: the scan beats the chunked form
    c.model.chunk_size = 32
    c.max_minutes = 10.0
  else:
    # Sized from the H200 run of 2026-11-29 (docs/EXPERIMENTS.md): 400 steps left every model
    # at chance, and a cell of 400 steps x 64 x 3 LRs took 0.8-3.5 s at T 128 after compiling,
    # so 3,000 steps on T 128 (18 cells) fit about 9 minutes with the compiles.
    c.vocab = 8192
    c.seq_lens = (128,)
    c.num_pairs = (8, 16, 32)
    c.d_models = (128,)
    c.lrs = (3e-4, 1e-3, 3e-3)
    c.steps, c.batch_size = 3000, 64
    c.model.dtype = "bfloat16"
    c.max_minutes = 9.0
  c.niah = _niah()
  c.lock()
  return c
