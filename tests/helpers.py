"""Shared test utilities: random mixer inputs (docs/MATH.md §9) and the relative-error metric."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from lineax_attn import ops
from lineax_attn.ops import specs

MIXERS = ops.MIXERS  # every `specs.MixerSpec`, by canonical name


def rel_err(x, ref) -> float:
  """rms(x − ref) / rms(ref), FLA's metric (docs/MATH.md §9); 0 when both are ~0."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  num = np.sqrt(np.mean((x - ref) ** 2))
  den = np.sqrt(np.mean(ref ** 2))
  if num <= 1e-6 and den <= 1e-6:
    return 0.0
  return float(num / max(den, 1e-30))


def assert_close(x, ref, tol, name=""):
  """Passes if max|x − ref| <= 1e-6 or rel_err < tol (docs/MATH.md §9)."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  assert x.shape == ref.shape, f"{name}: shape {x.shape} != {ref.shape}"
  assert np.all(np.isfinite(x)), f"{name}: non-finite values"
  if np.max(np.abs(x - ref), initial=0.0) <= 1e-6:
    return
  err = rel_err(x, ref)
  assert err < tol, f"{name}: relative error {err:.3e} >= {tol:.1e}"


def l2norm(x, axis=-1):
  return x / jnp.sqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-6)


def make_inputs(mixer, *, b=2, t=75, h=2, hv=None, dk=16, dv=24, tau=1.0, dtype=jnp.float32,
                seed=0, with_state=True):
  """Random inputs of docs/MATH.md §9 (`specs.random_inputs`: unit q/k, β/b/w = σ(N(0,1)),
  g = logsigmoid(N(0,1))/τ), q, k, v in `dtype`, gates and state float32.

  Returns (args, kwargs): args are the positional arrays of `getattr(ops, mixer)`.
  """
  q, k, v, gates, s0 = specs.random_inputs(mixer, b=b, t=t, h=h, hv=hv, dk=dk, dv=dv, tau=tau,
                                           seed=seed, with_state=with_state)
  args = tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + tuple(jnp.asarray(g) for g in gates)
  return args, ({"initial_state": jnp.asarray(s0)} if with_state else {})


def run(mixer, args, **kwargs):
  return getattr(ops, mixer)(*args, **kwargs)


def run_jit(mixer, args, **kwargs):
  """`run` as one jitted program: the array keywords are its arguments, the rest static.

  Eager calls compile every primitive on its own; for the interpreted kernels and their glue
  that is ~3x the CPU time of one compile of the whole op (measured: a GDN gradient under
  shard_map, 26 s eager, 7 s jitted). What the op computes is the same program."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
  static = {k: v for k, v in kwargs.items() if k not in arrays}
  return jax.jit(lambda a, kw: run(mixer, a, **kw, **static))(tuple(args), arrays)


def mosaic_gpu_or_skip():
  """For the Mosaic GPU kernel test modules: (on_gpu, interpret params). Skips the module when
  this jax has no Mosaic GPU Pallas backend or the GPU is not Hopper; off GPU the kernels run in
  JAX's Mosaic GPU interpreter."""
  import pytest  # pylint: disable=g-import-not-at-top
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu",
                              reason="this jax has no Mosaic GPU Pallas backend")
  from lineax_attn.ops import pallas_gpu  # pylint: disable=g-import-not-at-top
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu and not pallas_gpu.is_hopper():
    pytest.skip(f"the Mosaic GPU kernels need a Hopper GPU (sm_90), got "
                f"{jax.devices()[0].device_kind}", allow_module_level=True)
  return on_gpu, (None if on_gpu else plgpu.InterpretGPUParams())


def output_and_state_grads(mixer, args, initial_state, implementation, tuning=None,
                           segment_ids=None):
  """Gradients of <o, W_o> + <final_state, W_s> (fixed random weights) with respect to every
  positional input and the initial state (segment_ids: the call's, or None)."""
  w_o = jax.random.normal(jax.random.key(5), args[2].shape)
  w_s = jax.random.normal(jax.random.key(6), initial_state.shape)

  def f(*a):
    *xs, s_init = a
    o, s = run(mixer, xs, initial_state=s_init, output_final_state=True,
               segment_ids=segment_ids, implementation=implementation, tuning=tuning)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)
  # One jitted program (see run_jit: eager dispatch compiles each primitive on its own).
  return jax.jit(jax.grad(f, argnums=tuple(range(len(args) + 1))))(*args, initial_state)


def tensorboard_scalars(logdir) -> dict[tuple[str, int], list[float]]:
  """Every scalar of every TensorBoard event file in `logdir`: (tag, step) -> the values
  written for it, in file order. Reads the TFRecord framing itself (uint64 length, uint32 CRC,
  payload, uint32 CRC) and decodes the payload with tensorboardX's Event proto."""
  import collections  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top

  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  scalars = collections.defaultdict(list)
  for name in sorted(os.listdir(logdir)):
    if not name.startswith("events.out.tfevents."):
      continue
    with open(os.path.join(logdir, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      payload = data[pos + 12:pos + 12 + length]
      pos += 12 + length + 4
      if len(payload) < length:
        break  # a torn last record
      event = event_pb2.Event.FromString(payload)
      for value in event.summary.value:
        scalars[(value.tag, int(event.step))].append(value.simple_value)
  return dict(scalars)


def record_smem_estimates(monkeypatch) -> list:
  """A list that fills, as Mosaic GPU kernels are lowered, with Pallas's own estimate of each
  kernel's shared memory as its launch will request it (private API of the pinned jax: the
  last entry after a lowering is that kernel's total)."""
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # pylint: disable=g-import-not-at-top
  estimates = []
  estimate = mgpu_lowering._estimate_resources

  def recording(*a, **kw):
    rs = estimate(*a, **kw)
    estimates.append(rs.smem_scratch_bytes)
    return rs
  monkeypatch.setattr(mgpu_lowering, "_estimate_resources", recording)
  return estimates


def fast_cpu_xla(devices: int = 1) -> str:
  """XLA flags for a program a test starts: `devices` CPU devices and no backend optimisation,
  so it compiles in seconds."""
  return (f"--xla_force_host_platform_device_count={devices} "
          "--xla_backend_optimization_level=0")


FAST_CPU_XLA = fast_cpu_xla()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_env(xla_flags: str | None = None, **extra: str) -> dict[str, str]:
  """This process's environment for a child on the CPU: JAX_PLATFORMS=cpu, XLA_FLAGS when given,
  and `extra` variables."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  return env


def run_cpu_python(args, *, xla_flags: str | None = None, timeout: int = 600):
  """`python args...` from the repository root on the CPU (cpu_env), its output captured: how
  the tests run a program end to end."""
  return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=cpu_env(xla_flags),
                        capture_output=True, text=True, timeout=timeout)


def run_cpu_program(module: str, *args, timeout: int = 600):
  """`python -m module args...` on the CPU (run_cpu_python): an experiments/ program."""
  return run_cpu_python(["-m", module, *args], timeout=timeout)
