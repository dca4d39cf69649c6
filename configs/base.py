"""The base config at three sizes; every comparison file starts from it.

    python -m experiments.train --config=configs/base.py:tiny --workdir=runs/base

Mesh (`config.mesh`): `data` (-1: all remaining devices), `fsdp`, `tensor`, and `sequence`
(context parallelism, default 1): `--config.mesh.sequence=2 --config.mesh.data=-1` splits every
row's time axis over 2 devices (train.seq_len must divide; see docs/CONTEXT_PARALLEL.md).
`experiment.resolve` validates the sizes against the device count.

Sizes:

* `tiny`: CPU, minutes. d 64, 2 layers, byte tokens, T 128, batch 8, 250 steps.
* `small`: one H200 in a few minutes. d 512, 8 layers (about 26M parameters with the byte
  vocabulary), T 1024, batch 32 (32K tokens per step), 1000 steps (33M tokens). Measured on one
  H200 (GDN 2:1, chunked pure-JAX GDN, bf16): 165K tokens/s, so about 3.5 minutes per arm
  after compiling.
* `paper`: the 350M runs of docs/MATH.md §6.3-6.6: GDN 2:1 hybrid, 20 layers, d 1024, FFN 2816,
  vocabulary 32,000, T 4096, batch 128 x 4096 tokens, 28,610 steps (15B tokens); AdamW 3e-4 ->
  3e-5 (the Muon arms: matrix LR 3.6e-4, scalar Adam 1.5e-3), WSD with 200 warmup steps and a
  minus_sqrt decay over the last 20 %, clip 1.0, weight decay 0.1; documents concatenated with
  no reset; validation every 500 steps on 10 fixed batches; bf16 compute, fp32 master weights.
  Point it at the corpus and the LLaMA-2 tokenizer:
  `--config.data.path=/data/fineweb_edu/train/*.jsonl --config.data.validation_path=...
  --config.data.tokenizer=/models/llama2/tokenizer.model`.
"""

from __future__ import annotations

import ml_collections

from lineax_attn.train import experiment

SIZES = ("tiny", "small", "paper")


def _tiny(config: ml_collections.ConfigDict) -> None:
  m = config.model
  m.d_model, m.n_layers, m.mixer = 64, 2, "gdn"
  m.num_heads, m.attn_heads, m.mlp_hidden = 2, 2, 128
  m.chunk_size = 32                   # the chunked form's fastest size at T=128 on CPU

  t = config.train
  t.steps, t.global_batch_size, t.seq_len = 250, 8, 128
  t.log_every, t.eval_every, t.eval_batches = 10, 25, 2
  t.checkpoint_every, t.keep_checkpoints = 125, 2

  o = config.optim
  o.name, o.learning_rate, o.min_learning_rate = "adamw", 3e-3, 3e-4
  o.adam_learning_rate = 3e-3         # the Muon arms' scalar group
  o.warmup_steps, o.decay_fraction = 25, 0.2

  config.data.shuffle_window = 64


def _small(config: ml_collections.ConfigDict) -> None:
  m = config.model
  m.d_model, m.n_layers, m.mixer = 512, 8, "gdn"
  m.num_heads, m.num_v_heads, m.head_dim_k, m.head_dim_v = 4, 8, 64, 64
  m.attn_heads, m.attn_kv_heads, m.attn_head_dim = 8, 2, 64
  m.mlp_hidden = 1408
  m.dtype, m.param_dtype = "bfloat16", "float32"

  t = config.train
  t.steps, t.global_batch_size, t.seq_len = 1000, 32, 1024
  t.log_every, t.eval_every, t.eval_batches = 25, 100, 4
  t.checkpoint_every, t.keep_checkpoints = 500, 2

  o = config.optim
  o.name, o.learning_rate, o.min_learning_rate = "adamw", 1e-3, 1e-4
  o.adam_learning_rate = 3e-3
  o.warmup_steps, o.decay_fraction = 100, 0.2


def _paper(config: ml_collections.ConfigDict) -> None:
  m = config.model                    # = lineax_attn.models.config.gdn_350m
  m.vocab_size, m.d_model, m.n_layers = 32000, 1024, 20
  m.mixer, m.linear_attention_freq = "gdn", 3
  m.num_heads, m.num_v_heads, m.head_dim_k, m.head_dim_v = 4, 8, 64, 64
  m.attn_heads, m.attn_kv_heads, m.attn_head_dim = 16, 4, 64
  m.mlp_hidden, m.rope_base, m.tie_embeddings = 2816, 500000.0, False
  m.dtype, m.param_dtype = "bfloat16", "float32"

  d = config.data
  d.reset_at_document_boundaries = False   # docs/MATH.md §6.4: concatenated, no state reset
  d.seed = 42
  d.shuffle_window = 1024

  t = config.train
  t.steps, t.global_batch_size, t.seq_len = 28_610, 128, 4096
  # 16 rows per micro-batch: 2 per GPU on 8 GPUs (docs/MATH.md §6.5).
  t.grad_accum_steps = 8
  t.log_every, t.eval_every, t.eval_batches = 10, 500, 10
  t.checkpoint_every, t.keep_checkpoints = 1000, 3
  t.seed = 42

  o = config.optim
  o.name, o.learning_rate, o.min_learning_rate = "adamw", 3e-4, 3e-5
  o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm = 0.9, 0.95, 1e-8, 0.1, 1.0
  o.adam_learning_rate = 1.5e-3       # Muon's scalar (non-matrix) group
  o.warmup_steps, o.decay_fraction, o.decay_shape = 200, 0.2, "minus_sqrt"


# The Muon settings of each size (the optimizer comparison and the Muon arms use them).
MUON = {
    "tiny": {"name": "muon", "learning_rate": 3e-3, "min_learning_rate": 3e-4,
             "adam_learning_rate": 3e-3},
    "small": {"name": "muon", "learning_rate": 1e-3, "min_learning_rate": 1e-4,
              "adam_learning_rate": 3e-3},
    "paper": {"name": "muon", "learning_rate": 3.6e-4, "min_learning_rate": 3.6e-5,
              "adam_learning_rate": 1.5e-3},
}

_BUILDERS = {"tiny": _tiny, "small": _small, "paper": _paper}


def get_config(size: str = "tiny") -> ml_collections.ConfigDict:
  """The base config of `size` (tiny | small | paper), locked: unknown fields fail."""
  size = size or "tiny"
  if size not in _BUILDERS:
    raise ValueError(f"Unknown config size {size!r}; expected one of {SIZES}")
  config = experiment.base_config()
  config.name = f"base_{size}"
  _BUILDERS[size](config)
  config.lock()
  return config


def mixer_overrides(mixer: str, size: str) -> dict:
  """Model overrides that turn the size's base model into `mixer`'s (docs/MATH.md §6.3 rows at
  "paper" size: Transformer++ = 24 softmax layers, FFN 2560; DeltaNet = 4 heads of (64, 128),
  SDPA without output gate; KDA and GDN-2 = the GDN shapes)."""
  model: dict = {"mixer": mixer}
  if mixer == "softmax":
    model["linear_attention_freq"] = None
    if size == "paper":
      model.update(n_layers=24, mlp_hidden=2560, attn_output_gate=False)
  elif mixer == "deltanet" and size == "paper":
    model.update(num_v_heads=None, head_dim_k=64, head_dim_v=128, attn_output_gate=False)
  return {"model": model}


def merge(*overrides: dict) -> dict:
  """Nested merge of override dicts (later wins)."""
  out: dict = {}
  for item in overrides:
    for key, value in item.items():
      if isinstance(value, dict) and isinstance(out.get(key), dict):
        out[key] = merge(out[key], value)
      else:
        out[key] = value
  return out


def arms(mapping: dict) -> ml_collections.ConfigDict:
  """The arms of a comparison, in the order given (compare.py runs and tabulates them so)."""
  return ml_collections.ConfigDict(mapping, sort_keys=False)
