"""`ModelConfig`: a frozen dataclass that says everything about a decoder-only model, validated
at construction, plus named presets (docs/MATH.md §6.1-6.3).

The stack is a mixer per layer, resolved from (in this order of precedence):

* `pattern` as a tuple of mixer names, one per layer;
* `pattern` as a string, repeated cyclically over `n_layers`: compact letters `"L"` (the linear
  `mixer`) and `"S"` (softmax attention), e.g. `"LLS"` = 2:1 and `"LLLS"` = 3:1, or comma
  separated names, e.g. `"gdn,kda,softmax"`;
* `linear_attention_freq = N`, the repo's rule: layer i is softmax iff (i + 1) mod N == 0
  (N = 3 is the paper's 2:1 stack);
* otherwise every layer is `mixer` (pure; `mixer="softmax"` is a Transformer++).

Mixer names: the layer names of `lineax_attn.ops.specs` ("linear_attention", "deltanet", "gdn",
"kda", "gdn2", "simple_gla") and "softmax" (aliases such as "gated_delta_rule", "delta_rule",
"attention", "sdpa" are accepted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from lineax_attn.layers.linear_mixer import LINEAR_MIXERS
from lineax_attn.layers.norm import OUTPUT_GATES
from lineax_attn.ops import specs
from lineax_attn.ops.gpu_tuning import GpuTuning

SOFTMAX = "softmax"
MIXERS = LINEAR_MIXERS + (SOFTMAX,)
_SOFTMAX_ALIASES = ("softmax", "attention", "sdpa", "attn", "transformer")
ROUTING_MODES = (None, "cler", "cler_h", "clvr")
CLER_GAMMA_SHAPES = ("scalar", "head", "channel")


def canonical_mixer(name: str) -> str:
  """Canonical mixer name for any accepted spelling; ValueError for an unknown one."""
  key = str(name).strip().lower()
  if key in _SOFTMAX_ALIASES:
    return SOFTMAX
  try:
    return specs.resolve(key).layer_name
  except ValueError:
    raise ValueError(f"unknown mixer {name!r}; expected one of {MIXERS} (aliases: "
                     f"{sorted(set(specs.all_names()) | set(_SOFTMAX_ALIASES))}).") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes, stack, routing and numerics of a `LanguageModel`. Invalid combinations raise a
  `ValueError` at construction.

  Attributes (grouped):
    vocab_size, d_model, n_layers: the usual.
    mixer: the linear mixer of the stack (or "softmax" for a pure Transformer).
    pattern / linear_attention_freq: hybrid stack (module docstring).
    num_heads, num_v_heads, head_dim_k, head_dim_v: linear-mixer heads (H_k, H_v, d_k, d_v);
      head_dim_k defaults to d_model // num_heads, head_dim_v to head_dim_k, num_v_heads to
      num_heads. All linear layers of a stack share them (routing needs that).
    conv_width, output_gate (None = per-mixer default), gate_rank (KDA low rank, default d_v),
      gate_init ("repo" | "fla" | "long" | "very_long"), gate_lower_bound, allow_neg_eigval: linear-mixer options.
    implementation, chunk_size: how the linear ops run ("scan", "chunk", a kernel, None = best).
    gpu_tuning: the linear layers' `pallas_gpu` tuning: an `ops.GpuTuning`, its command-line
      spelling "field=value,..." (`GpuTuning.parse`, e.g. "remat_intra=false"), its fields as a
      mapping (what `dataclasses.asdict` gives back), or None (the defaults); stored as a
      GpuTuning.
    remat_conv_norm: the linear layers recompute their short conv and norms in the backward
      (`LinearMixer`'s option: less activation memory, the same values); None = each mixer's
      default (on but for GDN-2).
    attn_heads, attn_kv_heads, attn_head_dim, attn_output_gate (None = on when the linear mixer
      is GDN, KDA or GDN-2, as in the repo's runs), attn_implementation, rope_base, window.
    mlp_hidden (default round(mlp_ratio · d_model)), tie_embeddings.
    routing: None | "cler" (CLER v1) | "cler_h" | "clvr" (docs/MATH.md §5);
      routing_rank: rank of the CLER-H/CLVR projection P (None = full rank);
      routing_norm: RMS-normalise the routed residual (CLER v1's N, CLER-H's input norm);
      cler_gamma: "scalar" | "head" | "channel"; cler_gamma_init (0.0).
    norm_eps, init_std, scaled_out_init (W_out and MLP down at init_std / sqrt(2 · n_layers)).
    dtype (compute), param_dtype (master weights).
    scan_layers: build the stack as a `jax.lax.scan` over its repeating period of blocks
      (`scan_period`: 1 for a pure stack, 3 for "LLS"), each position's parameters stacked on a
      leading "layers" axis (`scan_rows`); the layers after the last whole period run in one
      more iteration, the positions they lack skipped. The same function and the same initial
      parameters (stacked) as the unrolled model; the train step traces and compiles one
      period instead of every layer (docs/BENCHMARKS.md).
  """

  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  mixer: str = "gdn"
  pattern: str | tuple[str, ...] | None = None
  linear_attention_freq: int | None = None
  # Linear mixers.
  num_heads: int = 2
  num_v_heads: int | None = None
  head_dim_k: int | None = None
  head_dim_v: int | None = None
  conv_width: int = 4
  output_gate: str | None = None
  gate_rank: int | None = None
  gate_init: str = "repo"
  gate_lower_bound: float | None = None
  allow_neg_eigval: bool = False
  implementation: str | None = None
  gpu_tuning: Any = None
  remat_conv_norm: bool | None = None
  chunk_size: int = 64
  # Softmax attention.
  attn_heads: int = 2
  attn_kv_heads: int | None = None
  attn_head_dim: int | None = None
  attn_output_gate: bool | None = None
  attn_implementation: str | None = None
  rope_base: float = 500000.0
  window: int | None = None
  # MLP and embeddings.
  mlp_hidden: int | None = None
  mlp_ratio: float = 2.75
  tie_embeddings: bool = False
  # Cross-layer routing.
  routing: str | None = None
  routing_rank: int | None = None
  routing_norm: bool = False
  cler_gamma: str = "scalar"
  cler_gamma_init: float = 0.0
  # Numerics and init.
  norm_eps: float = 1e-5
  init_std: float = 0.02
  scaled_out_init: bool = True
  dtype: Any = "float32"
  param_dtype: Any = "float32"
  # Compile: a scan over the repeating period of blocks instead of every layer traced.
  scan_layers: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "num_heads", "attn_heads", "conv_width"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    layer_types = self._resolve_layers()  # raises on unknown names / bad pattern
    if self.remat_conv_norm is not None and not isinstance(self.remat_conv_norm, bool):
      raise ValueError(f"remat_conv_norm must be a bool or None (each mixer's default), got "
                       f"{self.remat_conv_norm!r}.")
    if isinstance(self.gpu_tuning, str):
      try:
        object.__setattr__(self, "gpu_tuning", GpuTuning.parse(self.gpu_tuning))
      except ValueError as e:
        raise ValueError(f"gpu_tuning: {e}") from e
    elif isinstance(self.gpu_tuning, Mapping):  # e.g. back from dataclasses.asdict / JSON
      try:
        object.__setattr__(self, "gpu_tuning", GpuTuning(**self.gpu_tuning))
      except TypeError as e:
        raise ValueError(f"gpu_tuning: {e}") from e
    elif self.gpu_tuning is not None and not isinstance(self.gpu_tuning, GpuTuning):
      raise ValueError(f"gpu_tuning must be an ops.GpuTuning, its fields as a mapping, a "
                       f"\"field=value,...\" string or None, got {self.gpu_tuning!r}.")
    object.__setattr__(self, "pattern", self.pattern if not isinstance(self.pattern, list)
                       else tuple(self.pattern))
    object.__setattr__(self, "mixer", canonical_mixer(self.mixer))
    has_linear = any(k != SOFTMAX for k in layer_types)
    has_softmax = SOFTMAX in layer_types
    if has_linear:
      if self.head_dim_k is None and self.d_model % self.num_heads:
        raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                         f"set head_dim_k or choose heads that divide d_model.")
      if self.num_v_heads is not None and (self.num_v_heads <= 0
                                           or self.num_v_heads % self.num_heads):
        raise ValueError(f"num_v_heads={self.num_v_heads} must be a positive multiple of "
                         f"num_heads={self.num_heads} (grouped value heads).")
      if self.output_gate is not None and self.output_gate not in OUTPUT_GATES:
        raise ValueError(f"output_gate must be one of {OUTPUT_GATES} or None, got {self.output_gate!r}.")
      if self.chunk_size <= 0 or self.chunk_size % 16:
        raise ValueError(f"chunk_size must be a positive multiple of 16, got {self.chunk_size}.")
    if has_softmax:
      if self.attn_head_dim is None and self.d_model % self.attn_heads:
        raise ValueError(f"d_model={self.d_model} is not divisible by attn_heads={self.attn_heads}; "
                         f"set attn_head_dim or choose heads that divide d_model.")
      kv = self.attn_kv_heads or self.attn_heads
      if self.attn_heads % kv:
        raise ValueError(f"attn_heads={self.attn_heads} must be a multiple of "
                         f"attn_kv_heads={self.attn_kv_heads} (GQA).")
      if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
        raise ValueError(f"window must be a positive int or None, got {self.window!r}.")
    if self.routing not in ROUTING_MODES:
      raise ValueError(f"routing must be one of {ROUTING_MODES}, got {self.routing!r}.")
    if self.routing is not None and not has_linear:
      raise ValueError(f"routing={self.routing!r} needs at least one linear layer; the stack is "
                       f"all softmax.")
    if self.cler_gamma not in CLER_GAMMA_SHAPES:
      raise ValueError(f"cler_gamma must be one of {CLER_GAMMA_SHAPES}, got {self.cler_gamma!r}.")
    if self.routing_rank is not None and self.routing_rank <= 0:
      raise ValueError(f"routing_rank must be a positive int or None (full rank), got {self.routing_rank}.")
    if self.mlp_dim <= 0:
      raise ValueError(f"the MLP hidden width must be positive, got {self.mlp_dim}.")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}.")
    for name in ("dtype", "param_dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f"{name} must name a dtype, got {getattr(self, name)!r}.") from e

  # ----------------------------------------------------------------------------------------
  def _resolve_layers(self) -> tuple[str, ...]:
    n = self.n_layers
    mixer = canonical_mixer(self.mixer)
    if self.pattern is not None and self.linear_attention_freq is not None:
      raise ValueError("set at most one of `pattern` and `linear_attention_freq`.")
    if self.pattern is not None:
      if isinstance(self.pattern, (tuple, list)):
        names = [canonical_mixer(p) for p in self.pattern]
        if len(names) != n:
          raise ValueError(f"an explicit pattern needs one mixer per layer: got {len(names)} "
                           f"names for n_layers={n}.")
        return tuple(names)
      text = str(self.pattern).strip()
      if not text:
        raise ValueError("pattern must not be empty.")
      if "," in text:
        unit = [canonical_mixer(p) for p in text.split(",") if p.strip()]
      else:
        letters = {"L": mixer, "S": SOFTMAX}
        bad = sorted(set(text.upper()) - set(letters))
        if bad:
          raise ValueError(f"unknown letters {bad} in pattern {text!r}: use 'L' (the linear "
                           f"mixer) and 'S' (softmax), or comma-separated mixer names.")
        unit = [letters[c] for c in text.upper()]
        if "L" in text.upper() and mixer == SOFTMAX:
          raise ValueError("pattern letter 'L' needs `mixer` to name a linear mixer, not softmax.")
      return tuple(unit[i % len(unit)] for i in range(n))
    if self.linear_attention_freq is not None:
      freq = self.linear_attention_freq
      if not isinstance(freq, int) or freq <= 0:
        raise ValueError(f"linear_attention_freq must be a positive int, got {freq!r}.")
      if mixer == SOFTMAX:
        raise ValueError("linear_attention_freq needs `mixer` to name a linear mixer.")
      return tuple(SOFTMAX if (i + 1) % freq == 0 else mixer for i in range(n))
    return (mixer,) * n

  @property
  def layer_types(self) -> tuple[str, ...]:
    """The canonical mixer name of every layer."""
    return self._resolve_layers()

  @property
  def linear_layers(self) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(self.layer_types) if k != SOFTMAX)

  @property
  def scan_period(self) -> int:
    """The shortest period P of the layer kinds (kind i == kind i mod P for every layer): the
    blocks one iteration of the layer scan runs (`scan_layers`)."""
    kinds = self.layer_types
    return next(p for p in range(1, len(kinds) + 1)
                if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))

  @property
  def scan_rows(self) -> tuple[int, ...]:
    """Layers per position of the period (`scan_layers`): position j holds layers j, j + P,
    j + 2P, ... (row r = layer r·P + j), so the first n_layers mod P positions have one row
    more than the others (the layers after the last whole period, e.g. LL of 20 layers LLS...)."""
    p = self.scan_period
    return tuple(len(range(j, self.n_layers, p)) for j in range(p))

  @property
  def mlp_dim(self) -> int:
    return self.mlp_hidden if self.mlp_hidden is not None else int(round(self.mlp_ratio * self.d_model))

  @property
  def v_heads(self) -> int:
    return self.num_v_heads or self.num_heads

  @property
  def dk(self) -> int:
    return self.head_dim_k if self.head_dim_k is not None else self.d_model // self.num_heads

  @property
  def dv(self) -> int:
    return self.head_dim_v if self.head_dim_v is not None else self.dk

  @property
  def attention_output_gate(self) -> bool:
    if self.attn_output_gate is not None:
      return self.attn_output_gate
    # On when a linear mixer of the stack has an output gate by default (GDN, KDA, GDN-2).
    return any(k != SOFTMAX and specs.resolve(k).layer.output_gate != "none"
               for k in self.layer_types)

  @property
  def out_init_std(self) -> float:
    return self.init_std / (2 * self.n_layers) ** 0.5 if self.scaled_out_init else self.init_std

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------
# Presets. The 350M rows of docs/MATH.md §6.3 (Llama-2 vocabulary 32,000, untied, d = 1024).

# gpu_tuning: the backward keeps the XLA intra-chunk residuals of KDA / GDN-2 instead of
# recomputing them: +4 % (KDA) / +9.5 % (GDN-2) tokens/s for +11 / +21 GiB at 16 x 4096 on an
# H200 (docs/BENCHMARKS.md, "350M hybrids and remat_intra"); no effect on the other mixers.
_350M = dict(vocab_size=32000, d_model=1024, attn_heads=16, attn_kv_heads=4, attn_head_dim=64,
             rope_base=500000.0, tie_embeddings=False, gpu_tuning=GpuTuning(remat_intra=False))


def gdn_350m(**overrides) -> ModelConfig:
  """GDN 2:1 hybrid, 20 layers (14 GDN + 6 gated SDPA), FFN 2816: ≈ 290.3M total (§4.5)."""
  cfg = dict(_350M, n_layers=20, mixer="gdn", linear_attention_freq=3, num_heads=4,
             num_v_heads=8, head_dim_k=64, head_dim_v=64, mlp_hidden=2816)
  return ModelConfig(**{**cfg, **overrides})


def deltanet_350m(**overrides) -> ModelConfig:
  """DeltaNet 2:1 hybrid, 20 layers, SDPA without output gate: ≈ 276.5M total (§4.5)."""
  cfg = dict(_350M, n_layers=20, mixer="deltanet", linear_attention_freq=3, num_heads=4,
             head_dim_k=64, head_dim_v=128, mlp_hidden=2816, attn_output_gate=False)
  return ModelConfig(**{**cfg, **overrides})


def kda_350m(**overrides) -> ModelConfig:
  """KDA 2:1 hybrid, 20 layers (the AdamW launcher's depth)."""
  return gdn_350m(**{"mixer": "kda", **overrides})


def gdn2_350m(**overrides) -> ModelConfig:
  """GDN-2 2:1 hybrid, 20 layers."""
  return gdn_350m(**{"mixer": "gdn2", **overrides})


def softmax_350m(**overrides) -> ModelConfig:
  """Transformer++ baseline: 24 softmax layers, FFN 2560, no output gate: ≈ 317.2M total (§4.5)."""
  cfg = dict(_350M, n_layers=24, mixer="softmax", mlp_hidden=2560, attn_output_gate=False)
  return ModelConfig(**{**cfg, **overrides})


def timing_model(**overrides) -> ModelConfig:
  """The repo's timing model shapes (§6.3 "~7M"): 6 layers, d 256, FFN 256, GDN 2:1."""
  cfg = dict(vocab_size=32000, d_model=256, n_layers=6, mixer="gdn", linear_attention_freq=3,
             num_heads=4, num_v_heads=8, head_dim_k=64, head_dim_v=64, attn_heads=4,
             attn_kv_heads=1, attn_head_dim=64, mlp_hidden=256)
  return ModelConfig(**{**cfg, **overrides})


def tiny(**overrides) -> ModelConfig:
  """A CPU-sized model for tests and examples: 3 layers "LLS", d 64, vocab 256."""
  cfg = dict(vocab_size=256, d_model=64, n_layers=3, mixer="gdn", pattern="LLS", num_heads=2,
             num_v_heads=4, head_dim_k=16, head_dim_v=16, attn_heads=4, attn_kv_heads=2,
             mlp_hidden=128, chunk_size=16)
  return ModelConfig(**{**cfg, **overrides})


PRESETS = {
    "gdn_350m": gdn_350m, "deltanet_350m": deltanet_350m, "kda_350m": kda_350m,
    "gdn2_350m": gdn2_350m, "softmax_350m": softmax_350m, "timing_model": timing_model,
    "tiny": tiny,
}


def get_config(name: str, **overrides) -> ModelConfig:
  """A named preset with field overrides, e.g. `get_config("gdn_350m", routing="clvr")`."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}.")
  return PRESETS[name](**overrides)
