"""Context parallelism (the sequence axis sharded) equals the unsharded computation.

Oracle: the unsharded scan reference (implementation="scan") on the same global arrays; the
sharded runs use the chunked form inside. On the 8 fake CPU devices of conftest.py, with a (data=2, sequence=P) mesh or a
(sequence=P) mesh:

* every linear mixer, P in {2, 4, 8}: outputs o, the final state, the residual r, and the
  gradients of a random linear functional of (o, final state, r) with respect to q, k, v, every
  gate and initial_state. GVA (HV = 2H) everywhere. P = 4 and 8 run with segment ids that cross
  shard boundaries, start exactly at one, reuse an id (a new segment), contain padding, leading
  padding and whole padding shards; P = 2 runs without segment ids (the other code path).
  Tolerance (float32, matmul precision highest): rel_err (rms ratio) <= 5e-6 on values and
  gradients (measured <= 7e-7): the chunked form and the state combination only re-associate float32 sums.
* softmax attention with K/V all-gathered: outputs and gradients, with segments and a sliding
  window, rel_err <= 1e-5.
* the layers: a hybrid (GDN + softmax) train step on a (data=2, sequence=4) mesh, through the
  Trainer, equals the one-device step (loss to 1e-5 relative, every updated parameter to
  rel_err <= 2e-5), with packed documents (segment ids) crossing the shard boundaries.
* the shard_map without type checks (check_vma=False, used around the Pallas kernels) gives the
  same values and gradients.
* varlen (`cu_seqlens`) under context parallelism raises a ValueError; bad mesh.sequence
  settings fail in `experiment.resolve` naming the field.
* (slow) experiments/bench_parallel.py's three modes on 2 devices, losses equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from lineax_attn import ops
from lineax_attn import parallel
from tests.helpers import MIXERS, make_inputs, rel_err

T = 64
TOL = 5e-6
# XLA's CPU backend at optimisation level 0 compiles these graphs much faster; the SPMD
# partitioning and the collectives, which are what this file tests, are the same.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _segment_ids():
  """[2, 64]: segments crossing shard boundaries (shards of 8, 16, 32 tokens)."""
  seg = np.zeros((2, T), np.int32)
  seg[0, :20] = 1
  seg[0, 20:32] = 2       # crosses the 16-token boundary at 24 (P=8) ...
  seg[0, 32:45] = 3       # ... and a segment starts exactly at the boundary at 32
  seg[0, 36:41] = 0       # padding inside a segment
  seg[0, 45:] = 1         # a reused id: a new segment
  seg[1, 5:] = 7          # leading padding
  seg[1, 24:40] = 0       # padding over whole shards (P=8: [24, 32) and [32, 40))
  seg[1, 56:] = 8         # a segment starting at a shard boundary after padding-free tokens
  return jnp.asarray(seg)


def _mesh(p, data=1, tensor=1):
  """(data, sequence, tensor) mesh; the data and tensor axes split the batch and the heads."""
  devices = np.array(jax.devices()[:data * p * tensor]).reshape(data, p, tensor)
  return jax.sharding.Mesh(devices, ("data", "sequence", "tensor"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _cotangents(outs, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), outs)


def _values_and_grads(fn, args, s0, cot):
  """(o, final, r) and the gradients of <cot, (o, final, r)> wrt (args, initial_state)."""

  def loss(args, s0):
    outs = fn(args, s0)
    return sum(jnp.sum(a * c) for a, c in zip(outs, cot)), outs

  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(args, s0)
  return outs, grads


@functools.lru_cache(maxsize=None)
def _oracle(mixer):
  """Inputs, cotangents and the jitted unsharded op (segment ids an argument: one compile)."""
  args, kw = make_inputs(mixer, b=2, t=T, h=2, hv=4, dk=16, dv=16, seed=3)
  fn = lambda a, s0, seg: ops.__dict__[mixer](  # noqa: E731
      *a, initial_state=s0, output_final_state=True, segment_ids=seg, return_residual=True,
      chunk_size=16, implementation="scan")
  ones = jnp.ones((2, T), jnp.int32)
  cot = _cotangents(jax.eval_shape(fn, args, kw["initial_state"], ones), seed=7)
  run = jax.jit(lambda a, s0, seg: _values_and_grads(lambda a, s0: fn(a, s0, seg), a, s0, cot),
                compiler_options=COMPILER_OPTIONS)
  return args, kw["initial_state"], cot, run


def _unsharded(mixer, segmented):
  """(args, initial_state, segment_ids or None, cotangents, (outputs, grads) of the oracle).

  Without segments the oracle runs with all-ones ids (one segment per row: the same thing,
  docs/MATH.md §1.7), so one compile serves both cases.
  """
  args, s0, cot, run = _oracle(mixer)
  seg = _segment_ids() if segmented else None
  ids = seg if segmented else jnp.ones((2, T), jnp.int32)
  return args, s0, seg, cot, jax.device_get(run(args, s0, ids))


def _assert_tree_close(got, want, what):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert a.shape == b.shape, f"{what}{jax.tree_util.keystr(path)}: shape {a.shape} != {b.shape}"
    err = rel_err(a, b)
    assert err <= TOL, f"{what}{jax.tree_util.keystr(path)}: rel_err {err:.2e} > {TOL}"


# The default run: every mixer at P = 4 (segments); linear attention (its flag-only transition)
# at P = 2 without segments; GDN-2 (the augmented pass with the padded write gate) at P = 8 with
# segments, shards shorter than a chunk and whole padding shards. The rest of the {2, 4, 8} x
# mixers grid is marked slow: the same code at other sizes (run it with `-m slow`).
_FAST = {(m, 4) for m in MIXERS} | {("linear_attention", 2), ("gdn2", 8)}
_GRID = [pytest.param(m, p, marks=() if (m, p) in _FAST else pytest.mark.slow, id=f"{m}-P{p}")
         for p in (2, 4, 8) for m in MIXERS]


@pytest.mark.parametrize("mixer, p", _GRID)
def test_linear_mixer_matches_unsharded(mixer, p):
  segmented = p > 2
  args, s0, seg, cot, (want_outs, want_grads) = _unsharded(mixer, segmented)
  # Batch rows over "data" and (P = 2) heads over "tensor" too: both stay split in the body.
  mesh = _mesh(p, data=2 if p <= 4 else 1, tensor=2 if p == 2 else 1)
  fn = lambda a, s: parallel.sharded_mixer(  # noqa: E731
      mixer, *a, mesh=mesh, initial_state=s, output_final_state=True, segment_ids=seg,
      return_residual=True, chunk_size=16)
  run = jax.jit(lambda a, s: _values_and_grads(fn, a, s, cot), compiler_options=COMPILER_OPTIONS)
  outs, grads = jax.device_get(run(args, s0))
  _assert_tree_close(outs, want_outs, f"{mixer} P={p} (o, final, r)")
  _assert_tree_close(grads, want_grads, f"{mixer} P={p} grads")
  # The oracle's outputs are not trivially zero: the comparison means something.
  assert all(np.abs(x).max() > 1e-2 for x in want_outs)


def test_unchecked_shard_map_matches_unsharded(monkeypatch):
  """Around the Pallas kernels the shard_map runs with check_vma=False (their custom VJPs are
  not typed for it); that path gives the same values and gradients (chunk inside, P = 4)."""
  monkeypatch.setattr(parallel.context, "checks_types", lambda implementation: False)
  args, s0, seg, cot, (want_outs, want_grads) = _unsharded("delta_rule", True)
  mesh = _mesh(4, data=2)
  fn = lambda a, s: parallel.sharded_mixer(  # noqa: E731
      "delta_rule", *a, mesh=mesh, initial_state=s, output_final_state=True, segment_ids=seg,
      return_residual=True, chunk_size=16)
  run = jax.jit(lambda a, s: _values_and_grads(fn, a, s, cot), compiler_options=COMPILER_OPTIONS)
  outs, grads = jax.device_get(run(args, s0))
  _assert_tree_close(outs, want_outs, "unchecked (o, final, r)")
  _assert_tree_close(grads, want_grads, "unchecked grads")


def test_state_crosses_shards():
  """The comparisons above mean something: the shards depend on each other (shard 2's outputs
  change with shard 0's values), so a result without the carried state would fail them."""
  args = _oracle("delta_rule")[0]
  mesh = _mesh(4)
  run = jax.jit(lambda a: parallel.sharded_mixer("deltanet", *a, mesh=mesh, chunk_size=16)[0])
  o1 = run(args)
  v2 = args[2].at[:, :4].add(1.0)
  o2 = run(args[:2] + (v2,) + args[3:])
  assert rel_err(o2[:, 32:48], o1[:, 32:48]) > 1e-3


def test_varlen_and_bad_axis_are_rejected():
  args, _ = make_inputs("delta_rule", b=1, t=T, h=2, dk=16, dv=16, with_state=False)
  mesh = _mesh(4)
  with pytest.raises(ValueError, match="cu_seqlens.*segment_ids"):
    parallel.sharded_mixer("delta_rule", *args, mesh=mesh,
                           cu_seqlens=jnp.asarray([0, 20, T], jnp.int32))
  with pytest.raises(ValueError, match="divisible by the size 4"):
    parallel.sharded_mixer("delta_rule", *(x[:, :62] for x in args), mesh=mesh)
  with pytest.raises(ValueError, match="unknown `mixer`"):
    parallel.sharded_mixer("mamba", *args, mesh=mesh)
  with pytest.raises(ValueError, match="not a manual axis"):
    parallel.context_parallel("delta_rule", *args, axis_name="sequence")


@pytest.mark.parametrize("window, impl, strategy", [(None, "xla", "offset_mask"),
                                                     (24, "reference", "offset_mask"),
                                                     (24, "xla", "padded_queries")])
def test_softmax_attention_matches_unsharded(window, impl, strategy):
  """K/V all-gathered, causal mask offset by the shard position; segments cross shards."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, T, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, T, 2, 16)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, T, 2, 16)), jnp.float32)
  seg = _segment_ids()
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  mesh = _mesh(4, data=2) if impl == "xla" else _mesh(4, tensor=2)
  if strategy == "padded_queries":   # the cuDNN route on GPU; its arithmetic on CPU with XLA
    mesh = _mesh(4, tensor=2)

  def values_and_grads(attend):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * cot)  # noqa: E731
    return jax.jit(lambda *a: (attend(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)),
                   compiler_options=COMPILER_OPTIONS)(q, k, v)

  want = values_and_grads(lambda q, k, v: ops.softmax_attention(
      q, k, v, window=window, segment_ids=seg, implementation="reference"))
  got = values_and_grads(lambda q, k, v: parallel.sharded_attention(
      q, k, v, mesh=mesh, window=window, segment_ids=seg, implementation=impl,
      strategy=strategy))
  for name, a, b in zip(("o", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
    err = rel_err(a, b)
    assert err <= 1e-5, f"{impl} {strategy} window={window} {name}: rel_err {err:.2e}"


# ----------------------------------------------------------------------------- train step


def _hybrid_config():
  """A GDN + softmax ("LS") stack, small enough to compile fast on CPU."""
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.get_config("tiny")
  config.model.update(d_model=32, n_layers=2, pattern="LS", num_heads=2, num_v_heads=4,
                      head_dim_k=16, head_dim_v=16, attn_heads=2, mlp_hidden=64, chunk_size=16)
  config.train.update(global_batch_size=2, seq_len=T, steps=10, eval_batches=0)
  config.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-3)
  config.mesh.update(data=2, sequence=4)
  return config


def _train_step(exp, mesh, local_batch):
  from lineax_attn.train import loop  # pylint: disable=g-import-not-at-top
  trainer = loop.Trainer(exp, mesh=mesh, compiler_options=COMPILER_OPTIONS)
  params, opt_state = trainer.init()
  init = jax.device_get(params)
  batch = trainer.global_batch(local_batch)
  params, _, metrics = trainer.step(params, opt_state, batch)
  return init, float(metrics["loss"]), jax.device_get(params), batch


def _count_calls(monkeypatch, module, name):
  calls = []
  original = getattr(module, name)

  def spy(*args, **kwargs):
    calls.append(name)
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, spy)
  return calls


def test_hybrid_train_step_matches_single_device(monkeypatch):
  """Mesh (data=2, sequence=4): the Trainer splits each row's 64 tokens over 4 devices, the
  GDN and softmax layers run context parallel, packed documents (segment ids) cross the shard
  boundaries, padding included. Oracle: the same two AdamW steps on one device. Adam's eps is 1e-3 for the reason
  given in test_train_sharded.py (float32 rounding of near-zero gradients)."""
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import experiment  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  exp = experiment.resolve(_hybrid_config())
  it = pipeline_lib.make_iterator(exp.train_data, shard_index=0, shard_count=1)
  # The corpus' documents are longer than 64 tokens: pack them with our own segment layout
  # (segments crossing the 16-token shards, one starting exactly at a boundary, padding).
  seg = np.asarray(_segment_ids())
  batch = dict(next(it), segment_ids=seg, loss_mask=(seg != 0).astype(np.float32))
  single = _train_step(exp, sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]), batch)
  cp_mesh = sharding_lib.make_mesh(*exp.mesh_shape, sequence=exp.mesh.sequence)
  assert cp_mesh.axis_names == ("data", "fsdp", "sequence", "tensor")
  mixer_calls = _count_calls(monkeypatch, parallel.context, "sharded_mixer")
  attention_calls = _count_calls(monkeypatch, parallel.attention, "sharded_attention")
  sharded = _train_step(exp, cp_mesh, batch)
  # Both layers took the context-parallel path, and the batch's time axis is split.
  assert mixer_calls and attention_calls
  assert sharded[3]["inputs"].sharding.spec == PartitionSpec(("data", "fsdp"), "sequence")
  np.testing.assert_allclose(sharded[1], single[1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(sharded[0]), jax.tree.leaves(single[0])):
    np.testing.assert_array_equal(a, b)
  flat = jax.tree_util.tree_flatten_with_path(sharded[2])[0]
  for (path, a), b, init in zip(flat, jax.tree.leaves(single[2]), jax.tree.leaves(single[0])):
    name = jax.tree_util.keystr(path)
    assert not np.array_equal(b, init), f"{name} was not updated"
    err = rel_err(a, b)
    assert err <= 2e-5, f"{name}: rel_err {err:.2e} with the sequence axis sharded"


def test_mesh_sequence_config_is_validated():
  from configs import mixers  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import experiment  # pylint: disable=g-import-not-at-top
  config = mixers.get_config("tiny")
  assert config.mesh.sequence == 1  # the default: no context parallelism
  config.mesh.update(data=2, sequence=4)
  exp = experiment.resolve(config, device_count=8, process_count=1)
  assert (exp.mesh_shape, exp.mesh.sequence) == ((2, 1, 1), 4)
  config.mesh.update(sequence=3, data=-1)
  with pytest.raises(ValueError, match=r"Impossible mesh \(data=-1, fsdp=1, sequence=3"):
    experiment.resolve(config, device_count=8, process_count=1)
  config.mesh.update(sequence=0)
  with pytest.raises(ValueError, match="sequence.*>= 1"):
    experiment.resolve(config, device_count=8, process_count=1)
  config.mesh.update(sequence=8, data=1)
  config.train.update(seq_len=100)
  with pytest.raises(ValueError, match="seq_len=100 must be a multiple of mesh.sequence=8"):
    experiment.resolve(config, device_count=8, process_count=1)


@pytest.mark.slow
def test_bench_parallel_smoke():
  """experiments/bench_parallel.py's modes on 2 of the fake devices, a tiny hybrid, 2 steps:
  rows for single / data / context, and the data and context losses equal the one-device ones
  (float32: rel err <= 1e-5)."""
  from experiments import bench_parallel  # pylint: disable=g-import-not-at-top
  config = _hybrid_config()
  config.train.update(global_batch_size=4, seq_len=32)
  rows = [bench_parallel.run_mode(config, mode, 2, steps=2) for mode in bench_parallel.MODES]
  bench_parallel._compare(rows, loss_steps=2, rtol=1e-5)  # pylint: disable=protected-access
  assert [r["mesh"] for r in rows] == ["-", "data=2", "sequence=2"]
  for row in rows:
    assert row["tokens_per_s"] > 0 and len(row["losses"]) == 2
    assert row["matches"] == "yes", row
  table = bench_parallel._markdown(rows)  # pylint: disable=protected-access
  assert table.count("\n") == len(rows) + 1


def test_unknown_attention_strategy_is_a_value_error():
  q = jnp.zeros((2, T, 4, 16), jnp.float32)
  kv = jnp.zeros((2, T, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="strategy='ring'"):
    parallel.sharded_attention(q, kv, kv, mesh=_mesh(4, tensor=2), strategy="ring")
