"""The base config at three sizes; every comparison file starts from it.

    python -m experiments.train --config=configs/base.py:tiny --workdir=runs/base

Mesh (`config.mesh`): `data` (-1: all remaining devices), `fsdp`, `tensor`, and `sequence`
(context parallelism, default 1): `--config.mesh.sequence=2 --config.mesh.data=-1` splits every
row's time axis over 2 devices (train.seq_len must divide; see docs/CONTEXT_PARALLEL.md).
`lineax_attn.train.experiment.resolve` validates the sizes against the device count.

Configs are data: this file (and every configs/*.py) imports nothing of lineax_attn, only
ml_collections; `defaults()` spells out every field (tests/test_configs.py checks it against
the training dataclasses' defaults).

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
from ml_collections import config_dict

SIZES = ("tiny", "small", "paper")
# An optional field: None by default, typed so that the command line can set it.
_opt = config_dict.placeholder


def defaults() -> ml_collections.ConfigDict:
  """Every field of every section at its default (a tiny CPU run on the embedded corpus); unlocked.

  Plain data: configs import no training code. These are the defaults of the dataclasses that
  `lineax_attn.train.experiment.resolve` builds (model: `ModelConfig`, data: `DataConfig` less
  seq_len and global_batch_size plus path and validation_path, optim: `OptimizerConfig` less
  total_steps, train: `TrainSettings`, mesh: `MeshSettings`); tests/test_configs.py checks that
  they equal `experiment.base_config()`, which derives them from the dataclasses.
  """
  config = ml_collections.ConfigDict()
  config.name = "base"
  config.arm = ""
  config.model = ml_collections.ConfigDict(dict(
      vocab_size=_opt(int),             # None: the tokenizer's vocabulary, padded to 128
      d_model=64, n_layers=2, mixer="gdn", pattern=_opt(str), linear_attention_freq=_opt(int),
      num_heads=2, num_v_heads=_opt(int), head_dim_k=_opt(int), head_dim_v=_opt(int),
      conv_width=4, output_gate=_opt(str), gate_rank=_opt(int), gate_init="repo",
      gate_lower_bound=_opt(float), allow_neg_eigval=False, implementation=_opt(str),
      gpu_tuning=_opt(str), remat_conv_norm=_opt(bool), chunk_size=64,
      attn_heads=2, attn_kv_heads=_opt(int), attn_head_dim=_opt(int),
      attn_output_gate=_opt(bool), attn_implementation=_opt(str), rope_base=500000.0,
      window=_opt(int),
      mlp_hidden=_opt(int), mlp_ratio=2.75, tie_embeddings=False,
      routing=_opt(str), routing_rank=_opt(int), routing_norm=False, cler_gamma="scalar",
      cler_gamma_init=0.0,
      norm_eps=1e-5, init_std=0.02, scaled_out_init=True, dtype="float32",
      param_dtype="float32", scan_layers=False))
  config.data = ml_collections.ConfigDict(dict(
      source="embedded", format="auto", split="train", text_field="text", text_split="file",
      tokenizer="byte", add_bos=False, seed=42, shuffle=True, shuffle_window=256,
      num_epochs=_opt(int), reset_at_document_boundaries=True, worker_count=0, read_threads=2,
      prefetch_buffer_size=64, niah_mix=0.0, niah_template="ruler",
      path="", validation_path=""))     # path (if set) replaces source
  config.optim = ml_collections.ConfigDict(dict(
      name="adamw", learning_rate=3e-4, min_learning_rate=3e-5, warmup_steps=200,
      decay_fraction=0.2, decay_steps=_opt(int), decay_shape="minus_sqrt", b1=0.9, b2=0.95,
      eps=1e-8, weight_decay=0.1, clip_norm=1.0, muon_momentum=0.95, muon_nesterov=True,
      muon_ns_steps=5, muon_scale="spectral", adam_learning_rate=1.5e-3,
      adam_min_learning_rate=_opt(float)))
  config.train = ml_collections.ConfigDict(dict(
      steps=200, global_batch_size=8, seq_len=128, grad_accum_steps=1, log_every=10,
      eval_every=50, eval_batches=2, checkpoint_every=100, keep_checkpoints=2, seed=0,
      async_checkpoint=True))
  config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, sequence=1))
  config.arms = ml_collections.ConfigDict()
  return config


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
  m.gpu_tuning = "remat_intra=false"  # faster KDA/GDN-2 backward, more memory (BENCHMARKS.md)

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
  config = defaults()
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
