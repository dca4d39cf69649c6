"""One `MixerSpec` per linear mixer: the single place a mixer is defined.

Everything that differs between mixers is read from here: the op's gates (shape, range, test
distribution), the `lax.scan` step (the oracle), the map onto the shared chunk template, the
`pallas_tpu` kernel it runs on, the layer's projections and gate parametrisation, and the
names it answers to. `docs/ADDING_A_MIXER.md` is the recipe for adding one.

The shared template (docs/MATH.md §2.0), per value head with state S `[K, V]`:

    S̄_t = Diag(e^{g_t}) S_{t−1};   r_t = ṽ_t − S̄_tᵀ k̃_t;   S_t = S̄_t + k_t r_tᵀ;   o_t = S_tᵀ (scale q_t)

with k̃ = erase ⊙ k and ṽ = write ⊙ v. A mixer's `Template` names which of its gates plays the
decay g, the erase factor and the write factor (None: no decay / no delta edit / a write of 1).
The steps below are written out by hand per mixer, not derived from the template, so the scan
reference stays an independent check of the template map.

Vocabulary: a mixer has one canonical name (the op's, "gated_delta_rule"), one layer name (what
configs, checkpoints and tables print, "gdn") and aliases; `resolve` maps any of them to the
spec. This module imports only jax (no other part of lineax_attn).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

_HI = jax.lax.Precision.HIGHEST

# Where a gate's trailing axis lives beyond [B, T, HV]: None = one scalar per value head,
# "k" = per key channel, "v" = per value channel.
GATE_AXES = (None, "k", "v")
TEST_DISTRIBUTIONS = ("sigmoid", "logsigmoid")


@dataclasses.dataclass(frozen=True)
class Gate:
  """One gate argument of an op.

  name: the op's argument name. axis: see `GATE_AXES`. low, high: the closed range checked
  eagerly and in checked mode (None = unbounded). test: how tests and benchmarks draw it
  (docs/MATH.md §9): "sigmoid" = σ(N(0, 1)), "logsigmoid" = logsigmoid(N(0, 1)) / τ.
  Any float dtype is accepted; the ops compute in `dtype`.
  """
  name: str
  axis: str | None
  low: float | None
  high: float | None
  test: str
  doc: str = ""
  dtype: str = "float32"

  @property
  def is_log_decay(self) -> bool:
    return self.test == "logsigmoid"


@dataclasses.dataclass(frozen=True)
class Template:
  """Which gate plays which role in the shared template (None: absent)."""
  decay: str | None = None    # log decay g (scalar or per key channel)
  erase: str | None = None    # k̃ = erase ⊙ k (None: no delta edit, k̃ = 0)
  write: str | None = None    # ṽ = write ⊙ v (None: ṽ = v)


@dataclasses.dataclass(frozen=True)
class LayerGate:
  """How `LinearMixer` makes one op gate from its input.

  source: the in-projection part it is read from, or "low_rank" (KDA's d → rank → HV·d_k branch).
  heads: "v" (one per value head) or "k" (per key head, repeated to the value heads).
  kind: "decay" (g = −exp(A_log)·softplus(f + dt_bias), A_log and dt_bias per `heads`; per key
    channel dt_bias when the op gate is per key channel) or "sigmoid" (σ; 2σ with
    `allow_neg_eigval` when `neg_eigval`).
  """
  gate: str
  source: str
  heads: str = "v"
  kind: str = "sigmoid"
  neg_eigval: bool = False


@dataclasses.dataclass(frozen=True, eq=False)  # one instance per mixer: compared by identity
class LayerSpec:
  """The layer defaults of a mixer (docs/MATH.md §4.3).

  output_gate: default output gate ("none", "silu", "sigmoid").
  projections: the in-projection parts after q, k, v (and z, when the output gate is gated and
    comes from the projection), in this order (fixed: checkpoints depend on it).
  gates: one `LayerGate` per op gate, in the op's order.
  decay_init: A_log ~ U(low, high) and the dt_bias init ("ones" or "log_uniform": softplus⁻¹ of
    dt ~ LogU(1e-3, 0.1)) per `gate_init` preset "repo" / "fla" ("long" is shared, see
    `layers.gates`). None without a decay.
  low_rank: f (and z) come from KDA's low-rank branch, not the fused projection.
  remat_conv_norm: the layer's default for `LinearMixer(remat_conv_norm=None)`: recompute the
    short conv, norms and output norm in the backward. Off only where it measured slower and
    larger on the GPU (GDN-2: docs/LAYERS.md, "Memory").
  """
  output_gate: str = "none"
  projections: tuple[str, ...] = ()
  gates: tuple[LayerGate, ...] = ()
  decay_init: Mapping[str, tuple[float, float, str]] | None = None
  low_rank: bool = False
  remat_conv_norm: bool = True


@dataclasses.dataclass(frozen=True, eq=False)  # one instance per mixer: compared by identity
class MixerSpec:
  """A linear mixer, in one place.

  name: canonical (op) name; layer_name: the layer/config name; aliases: other spellings.
  gates: the op's gate arguments in order. step: the scan step
    `step(S [K, V], q [K], k [K], v [V], *gates) -> (S_new, o [V], r [V])` (q already scaled).
  template: the map to the shared chunk template. tpu_kernel: the name of its entry point in
    `pallas_kernels.tpu.MIXERS`, or None to run the generic `delta_template` on the template's
    (k̃, ṽ, g). gpu_intra_kernel: whether `pallas_gpu`'s Mosaic intra-chunk kernel (scalar or
    no decay with a β erase and write) handles it. summary: the recurrence, one line.
  """
  name: str
  layer_name: str
  aliases: tuple[str, ...]
  gates: tuple[Gate, ...]
  step: Callable
  template: Template
  layer: LayerSpec
  summary: str
  tpu_kernel: str | None = None
  gpu_intra_kernel: bool = False

  @property
  def gate_names(self) -> tuple[str, ...]:
    return tuple(g.name for g in self.gates)

  @property
  def gate_axes(self) -> tuple[tuple[str, str | None], ...]:
    """((name, axis), ...): the old `api.MIXER_GATES` row."""
    return tuple((g.name, g.axis) for g in self.gates)

  def gate(self, name: str) -> Gate:
    for g in self.gates:
      if g.name == name:
        return g
    raise ValueError(f"{self.name} has no gate {name!r}; its gates are {self.gate_names}.")

  @property
  def names(self) -> tuple[str, ...]:
    return (self.name, self.layer_name) + self.aliases


# ----------------------------------------------------------------------------------------------
# Gates shared by several mixers.

def _decay(axis):
  return Gate("g", axis, None, 0.0, "logsigmoid",
              "log decay α = e^g, <= 0 and finite" + (" per key channel" if axis else ""))


BETA = Gate("beta", None, 0.0, 2.0, "sigmoid",
            "write strength in [0, 2]: (0, 1) from a sigmoid, up to 2 with negative eigenvalues")
G_SCALAR, G_CHANNEL = _decay(None), _decay("k")

# A_log / dt_bias init presets (docs/MATH.md §4.4).
_GDN_INIT = {"repo": (1.0, 16.0, "ones"), "fla": (0.0, 16.0, "log_uniform")}
_KDA_INIT = {"repo": (1.0, 16.0, "log_uniform"), "fla": (1.0, 16.0, "log_uniform")}
_GDN2_INIT = {"repo": (1.0, 16.0, "ones"), "fla": (1.0, 16.0, "log_uniform")}  # NVlabs dt, repo A
_BETA_GATE = LayerGate("beta", "beta", neg_eigval=True)


# ----------------------------------------------------------------------------------------------
# The scan steps (docs/MATH.md §2): one (batch, value head), one token.

def _read(S, x):
  """Sᵀ x for S [K, V], x [K] -> [V]."""
  return jnp.dot(x, S, precision=_HI)


def linear_attention_step(S, q, k, v):
  S = S + jnp.outer(k, v)
  return S, _read(S, q), v


def delta_rule_step(S, q, k, v, beta):
  r = beta * (v - _read(S, k))
  S = S + jnp.outer(k, r)
  return S, _read(S, q), r


def gated_delta_rule_step(S, q, k, v, g, beta):
  S = jnp.exp(g) * S  # scalar decay
  r = beta * (v - _read(S, k))
  S = S + jnp.outer(k, r)
  return S, _read(S, q), r


def kda_step(S, q, k, v, g, beta):
  S = jnp.exp(g)[:, None] * S  # per key channel decay
  r = beta * (v - _read(S, k))
  S = S + jnp.outer(k, r)
  return S, _read(S, q), r


def gdn2_step(S, q, k, v, g, b, w):
  S = jnp.exp(g)[:, None] * S
  r = w * v - _read(S, b * k)  # erase along key channels by b, write gated by w
  S = S + jnp.outer(k, r)
  return S, _read(S, q), r


# ----------------------------------------------------------------------------------------------
# The specs.

SPECS: dict[str, MixerSpec] = {}


def register(spec: MixerSpec) -> MixerSpec:
  """Adds `spec` to `SPECS` (its names must be new, its fields consistent)."""
  taken = {n for s in SPECS.values() for n in s.names}
  clash = [n for n in spec.names if n.lower() in taken]
  if clash:
    raise ValueError(f"mixer names {clash} of {spec.name!r} are already taken.")
  for gate in spec.gates:
    if gate.axis not in GATE_AXES or gate.test not in TEST_DISTRIBUTIONS:
      raise ValueError(f"{spec.name}: gate {gate.name!r} has axis {gate.axis!r} / test "
                       f"{gate.test!r}; expected {GATE_AXES} / {TEST_DISTRIBUTIONS}.")
  used = [n for n in dataclasses.astuple(spec.template) if n is not None]
  if not set(used) <= set(spec.gate_names):
    raise ValueError(f"{spec.name}: template {spec.template} names gates outside {spec.gate_names}.")
  if tuple(lg.gate for lg in spec.layer.gates) != spec.gate_names:
    raise ValueError(f"{spec.name}: layer gates must be the op gates {spec.gate_names} in order.")
  SPECS[spec.name] = spec
  return spec


register(MixerSpec(
    name="linear_attention", layer_name="linear_attention", aliases=("la",), gates=(),
    step=linear_attention_step, template=Template(), layer=LayerSpec(output_gate="none"),
    summary="S_t = S_{t−1} + k_t v_tᵀ", tpu_kernel="linear_attention"))

register(MixerSpec(
    name="delta_rule", layer_name="deltanet", aliases=("dn",), gates=(BETA,),
    step=delta_rule_step, template=Template(erase="beta", write="beta"),
    layer=LayerSpec(output_gate="none", projections=("beta",), gates=(_BETA_GATE,)),
    summary="S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ", tpu_kernel="delta_rule",
    gpu_intra_kernel=True))

register(MixerSpec(
    name="gated_delta_rule", layer_name="gdn", aliases=("gated_deltanet",),
    gates=(G_SCALAR, BETA), step=gated_delta_rule_step,
    template=Template(decay="g", erase="beta", write="beta"),
    layer=LayerSpec(output_gate="silu", projections=("beta", "f"),
                    gates=(LayerGate("g", "f", kind="decay"), _BETA_GATE), decay_init=_GDN_INIT),
    summary="S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, α_t = e^{g_t} per value head",
    tpu_kernel="gated_delta_rule", gpu_intra_kernel=True))

register(MixerSpec(
    name="kda", layer_name="kda", aliases=(), gates=(G_CHANNEL, BETA), step=kda_step,
    template=Template(decay="g", erase="beta", write="beta"),
    layer=LayerSpec(output_gate="sigmoid", projections=("beta",),
                    gates=(LayerGate("g", "low_rank", kind="decay"), _BETA_GATE),
                    decay_init=_KDA_INIT, low_rank=True),
    summary="S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ, α_t per key channel",
    tpu_kernel="kda"))

register(MixerSpec(
    name="gdn2", layer_name="gdn2", aliases=("gdn-2", "gated_deltanet2"),
    gates=(G_CHANNEL,
           Gate("b", "k", 0.0, 2.0, "sigmoid", "erase gate along key channels, in [0, 2]"),
           Gate("w", "v", 0.0, 1.0, "sigmoid", "write gate along value channels, in [0, 1]")),
    step=gdn2_step, template=Template(decay="g", erase="b", write="w"),
    # GDN-2's f, b, A_log and dt_bias live per key head, repeated to the value heads (§2.6).
    layer=LayerSpec(output_gate="silu", projections=("b", "w", "f"),
                    gates=(LayerGate("g", "f", heads="k", kind="decay"),
                           LayerGate("b", "b", heads="k", neg_eigval=True), LayerGate("w", "w")),
                    # Recomputing the front made the 350M GDN-2 step slower and its peak larger
                    # on both GPUs measured (docs/BENCHMARKS.md "thirty-first stage").
                    decay_init=_GDN2_INIT, remat_conv_norm=False),
    summary="S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ",
    tpu_kernel="gdn2"))


def simple_gla_step(S, q, k, v, g):
  S = jnp.exp(g) * S + jnp.outer(k, v)  # scalar decay, plain write: no delta edit (r = v)
  return S, _read(S, q), v


register(MixerSpec(
    # Mamba-2's SSD core: q = C, k = B, v = dt·x, g = dt·A (A < 0).
    name="simple_gla", layer_name="simple_gla", aliases=(), gates=(G_SCALAR,),
    step=simple_gla_step, template=Template(decay="g"),
    layer=LayerSpec(output_gate="none", projections=("f",),
                    gates=(LayerGate("g", "f", kind="decay"),), decay_init=_GDN_INIT),
    summary="S_t = α_t S_{t−1} + k_t v_tᵀ, α_t = e^{g_t} per value head (simple GLA)"))


def resolve(name) -> MixerSpec:
  """The spec `name` stands for: a canonical name, a layer name or an alias (any case)."""
  if isinstance(name, MixerSpec):
    return name
  key = str(name).lower()
  for spec in SPECS.values():
    if key in spec.names:
      return spec
  raise ValueError(f"unknown linear mixer {name!r}; expected one of {tuple(SPECS)} "
                   f"(aliases: {all_names()}).")


def all_names() -> list[str]:
  """Every accepted spelling, sorted."""
  return sorted({n for spec in SPECS.values() for n in spec.names})


def names() -> tuple[str, ...]:
  """The canonical (op) names, in registration order."""
  return tuple(SPECS)


def layer_names() -> tuple[str, ...]:
  """The layer/config names, in registration order."""
  return tuple(spec.layer_name for spec in SPECS.values())


# ----------------------------------------------------------------------------------------------
# Derived maps shared by every implementation and the test/benchmark inputs.

class SpecView(Mapping):
  """A live, read-only map: canonical mixer name -> one field of its spec (e.g. "step")."""

  def __init__(self, field: str):
    self._field = field

  def __getitem__(self, name):
    return getattr(SPECS[name], self._field)

  def __iter__(self):
    return iter(SPECS)

  def __len__(self):
    return len(SPECS)


def template_gates(spec, gates: Mapping[str, jax.Array]):
  """(g, erase, write) of the shared template from the op's (float32) gates.

  g: None, `[B, T, HV]` scalar or `[B, T, HV, K]` per channel log decay. erase: None (k̃ = 0) or
  the factor multiplying k (`[B, T, HV, 1]` or `[B, T, HV, K]`). write: the factor multiplying
  v (`[B, T, HV, 1]` or `[B, T, HV, V]`), or None for 1.
  """
  spec = resolve(spec)
  tpl = spec.template

  def factor(name):
    if name is None:
      return None
    x = gates[name]
    return x[..., None] if spec.gate(name).axis is None else x

  return (None if tpl.decay is None else gates[tpl.decay]), factor(tpl.erase), factor(tpl.write)


def gate_shape(gate: Gate, *, b: int, t: int, hv: int, dk: int, dv: int) -> tuple[int, ...]:
  return (b, t, hv) + {None: (), "k": (dk,), "v": (dv,)}[gate.axis]


def random_gates(spec, normal: Callable[[str, tuple[int, ...]], object], *, b: int, t: int,
                 hv: int, dk: int, dv: int, tau: float = 1.0, xp=jnp) -> tuple:
  """The op's gates drawn as docs/MATH.md §9 (each `Gate.test`), in the op's order.

  `normal(gate_name, shape)` returns N(0, 1) draws (numpy or jax: the caller's generator);
  `xp` is the array module they are in (numpy or jax.numpy). Log decays are divided by `tau`.
  """
  out = []
  for gate in resolve(spec).gates:
    x = normal(gate.name, gate_shape(gate, b=b, t=t, hv=hv, dk=dk, dv=dv))
    if gate.test == "sigmoid":
      out.append(1.0 / (1.0 + xp.exp(-x)))
    else:
      out.append(-xp.logaddexp(0.0, -x) / tau)
  return tuple(out)


def random_inputs(spec, *, b: int, t: int, h: int, hv: int | None = None, dk: int, dv: int,
                  tau: float = 1.0, seed: int = 0, with_state: bool = True):
  """Random op inputs of docs/MATH.md §9 as numpy float32, the one factory of tests and
  benchmarks: unit-norm q, k `[B, T, H, K]`, v ~ N(0, 1) `[B, T, HV, V]`, the gates of
  `random_gates`, and an initial state ~ N(0, 1) `[B, HV, K, V]` (None without `with_state`).

  numpy draws: jax.random would compile anew for every shape, which dominates small tests.
  Returns (q, k, v, gates tuple, initial_state).
  """
  hv = hv or h
  rng = np.random.default_rng(seed)
  n = lambda shape: rng.standard_normal(shape).astype(np.float32)
  unit = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
  q, k, v = unit(n((b, t, h, dk))), unit(n((b, t, h, dk))), n((b, t, hv, dv))
  gates = random_gates(spec, lambda _, shape: n(shape), b=b, t=t, hv=hv, dk=dk, dv=dv, tau=tau,
                       xp=np)
  return q, k, v, gates, (n((b, hv, dk, dv)) if with_state else None)
