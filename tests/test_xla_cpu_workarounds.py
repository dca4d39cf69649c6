"""Reproductions of two XLA CPU (YNNPACK fusion) bugs and the library's workarounds: the
miscompile behind KDA/GDN-2 `chunk`'s one-chunk garbage (`chunked._state_passing`'s barrier), and
a compile crash of the per-channel pair's reduce form (`chunked._channel_pair`'s CPU branch).

jax/jaxlib 0.11.2 on CPU: when a product P (built from a multiply + reduce) meets dots with a
zero state S that XLA sees as a constant, the CPU backend puts them into one YNNPACK fusion that
returns garbage or NaN on about half of all fresh compiles (the same executable is then wrong on
every call). A one-chunk sequence is exactly this: the chunk scan has one iteration, XLA inlines
it, and the zero initial state becomes a constant inside the fusion. Turning YNNPACK fusions off
(`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`) also cures it; an
`optimization_barrier` on S keeps it opaque and is what the library does, since a library cannot
set a process's XLA flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Every compile here must be XLA's own, not the suite's compilation cache's copy.
pytestmark = pytest.mark.usefixtures("fresh_compiles")

_HI = jax.lax.Precision.HIGHEST


def _pattern(x, y, u, w, *, barrier):
  s = jnp.zeros((2, 32, 32), jnp.float32)           # the chunk-entry state: zeros
  if barrier:
    s = jax.lax.optimization_barrier(s)
  p = jnp.tile((x * y).sum(axis=-1).reshape(2, 64, 16), (1, 1, 4))     # P [2, 64, 64]
  e = u - jnp.einsum("bck,bkv->bcv", w, s, precision=_HI)              # E = U − Y S
  return jnp.einsum("bij,bjv->biv", p, e, precision=_HI)               # O = P E


def _fresh_compile_errors(barrier, compiles=8):
  rng = np.random.default_rng(0)
  x, y = (jnp.asarray(rng.standard_normal((2, 4, 16, 16, 32)), jnp.float32) for _ in range(2))
  u, w = (jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32) for _ in range(2))
  # Oracle: float64 numpy (s = 0, so O = P U).
  p = np.tile((np.float64(x) * np.float64(y)).sum(-1).reshape(2, 64, 16), (1, 1, 4))
  ref = p @ np.float64(u)
  # A new function object per iteration: jax traces it anew and XLA compiles it afresh (no
  # jax.clear_caches(): in a long-lived test process that cleared every other test's caches too
  # and cost ~20 CPU-s). The listener proves each iteration was a backend compile of its own.
  backend_compiles = []
  listener = lambda event, *_, **__: backend_compiles.append(event) if (
      event == "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  errors = []
  try:
    for i in range(compiles):
      got = np.asarray(jax.jit(lambda *a: _pattern(*a, barrier=barrier))(x, y, u, w), np.float64)
      assert len(backend_compiles) == i + 1, "the pattern was not compiled afresh"
      errors.append(float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return errors


def test_optimization_barrier_on_the_zero_state_gives_exact_results_on_every_compile():
  errors = _fresh_compile_errors(barrier=True)
  assert all(e < 1e-5 for e in errors), errors


def test_the_unprotected_pattern_still_miscompiles_on_this_jax():
  # A canary for the pinned jaxlib: the reproduction must reproduce (else the test above proves
  # nothing). When an upgrade fixes XLA, this fails: then drop the barrier in
  # chunked._state_passing and this file. Each compile is wrong with probability ~1/2, so 16
  # all-correct compiles of a still-broken XLA happen 1 in 65536 runs.
  errors = _fresh_compile_errors(barrier=False, compiles=16)
  assert any(not (np.isfinite(e) and e < 1e-5) for e in errors), (
      f"XLA CPU's YNNPACK miscompile no longer reproduces on jax {jax.__version__}: the "
      f"optimization_barrier in lineax_attn.ops.chunked._state_passing may be unnecessary "
      f"(errors of 16 fresh compiles: {errors}).")


_CRASH = """
import jax, jax.numpy as jnp
def masked_exp(x, m): return jnp.where(m, jnp.exp(jnp.where(m, x, 0.0)), 0.0)
def pair(A, K, G):
  sh = A.shape[:-2] + (4, 16, 64)
  Ar, Kr, Gr = A.reshape(sh), K.reshape(sh), G.reshape(sh)
  anchor = Gr[..., :, :1, :]
  row = jnp.exp(Gr - anchor)
  col = masked_exp(anchor[..., :, None, :, :] - Gr[..., None, :, :, :], jnp.tril(jnp.ones((4, 4), bool), -1)[:, :, None, None])
  diag = masked_exp(Gr[..., :, :, None, :] - Gr[..., :, None, :, :], jnp.tril(jnp.ones((16, 16), bool))[:, :, None])
  off = jnp.einsum("...pic,...pqjc->...piqj", (Ar * row).astype(jnp.bfloat16), (Kr[..., None, :, :, :] * col).astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  on = jnp.sum(Ar[..., :, :, None, :] * Kr[..., :, None, :, :] * diag, axis=-1)
  return (off + on[..., :, :, None, :] * jnp.eye(4)[:, None, :, None]).reshape(A.shape[:-2] + (64, 64))
ks = jax.random.split(jax.random.key(0), 3)
a, k = (jax.random.normal(kk, (1, 2, 2, 64, 64)) for kk in ks[:2])
g = jnp.cumsum(-jax.random.uniform(ks[2], a.shape), axis=-2)
print(jax.jit(pair)(a, k, g).shape)
"""


def test_ynnpack_reduce_crash_reproduces_and_its_workaround():
  # jaxlib 0.11.2 on CPU: the per-channel pair matrix (as chunked._channel_pair first wrote it,
  # inlined above) with its diagonal blocks as a multiply-reduce over the channel axis of
  # [..., i, j, K] recurses without end in YNNPACK's (slinky) simplifier when it is a program
  # of its own, and the process dies (SIGSEGV). chunked._channel_pair therefore builds the
  # diagonal blocks with an einsum on CPU. Canary: when this stops crashing, that branch can go.
  import os
  import subprocess
  import sys
  run = lambda flags: subprocess.run(
      [sys.executable, "-c", _CRASH], capture_output=True, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags})
  fine = run("--xla_cpu_experimental_ynn_fusion_type=")
  assert fine.returncode == 0 and "(1, 2, 2, 64, 64)" in fine.stdout, fine.stderr[-2000:]
  crashed = run("")
  assert crashed.returncode != 0, "YNNPACK no longer crashes: drop the CPU branch of _channel_pair"
