"""The scanned layer stack (`ModelConfig.scan_layers`) against the unrolled model (the oracle).

* Period and rows per position of the layer kinds (hand-computed).
* The scanned model with the unrolled model's parameters stacked gives its logits and its
  gradients (unstacked) under `jax.jit`: softmax only, a GDN "LS" hybrid of 3 layers (the
  last iteration runs the third and skips the missing softmax), and "LS" hybrids with CLER
  (its residual rides in the scan carry) and with CLVR (a routed projection per block, the
  path CLER-H shares).
* Its own init (eager and `make_param_init`) is the unrolled init stacked; stack/unstack invert
  each other; the stacked parameters carry the "layers" logical axis, replicated by the rules.
* The optimisers (AdamW, Muon) update each stacked layer as they update the unrolled layer.
* Decoding a scanned model generates the unrolled model's tokens; inspect reads its layers.
* Training: the loss falls, the checkpoint holds the stacked layout and resumes bit for bit,
  and an unrolled run refuses the stacked checkpoint by name.
* The compiled train step's optimised HLO of a deeper stack is markedly smaller scanned.
* A context-parallel step of a scanned model equals the unrolled one-device step.
* bench_startup --compile_only compiles the scanned step on abstract inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base, mixers
from lineax_attn import inspect
from lineax_attn.models import config as config_lib
from lineax_attn.models import decode, lm
from lineax_attn.models import losses
from lineax_attn.train import experiment, loop, optim
from lineax_attn.train import sharding as sharding_lib

COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _config(**overrides):
  cfg = dict(d_model=32, num_heads=2, num_v_heads=2, head_dim_k=16, head_dim_v=16, attn_heads=2,
             attn_kv_heads=1, mlp_hidden=64, vocab_size=64)
  return config_lib.tiny(**{**cfg, **overrides})


def _pure(model):
  return nnx.to_pure_dict(nnx.state(model))


def _tokens(b=2, t=32, vocab=64, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def _loss_and_grads(model, tokens):
  graphdef, state = nnx.split(model)

  @jax.jit(compiler_options=COMPILER_OPTIONS)
  def run(state):
    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens[:, :-1])
      targets = tokens[:, 1:]
      return losses.masked_cross_entropy(logits, targets, jnp.ones(targets.shape)), logits
    return jax.value_and_grad(loss, has_aux=True)(state)

  (value, logits), grads = run(state)
  return value, logits, nnx.to_pure_dict(grads)


def test_period_and_rows():
  hybrid = _config(n_layers=8, pattern="LLS")
  assert (hybrid.scan_period, hybrid.scan_rows) == (3, (3, 3, 2))
  freq = config_lib.gdn_350m()  # linear_attention_freq=3, 20 layers: LLS x 6 + LL
  assert (freq.scan_period, freq.scan_rows) == (3, (7, 7, 6))
  pure = config_lib.softmax_350m()
  assert (pure.scan_period, pure.scan_rows) == (1, (24,))
  # Two layers of "LLS" are both linear: one block per period.
  assert _config(n_layers=2, pattern="LLS").scan_period == 1
  with pytest.raises(ValueError, match="scan_layers"):
    _config(scan_layers=1)
  # The default: unrolled everywhere (on an H200 the scanned 350M models train slower or do
  # not fit: docs/BENCHMARKS.md); scanning is opt-in.
  assert not config_lib.ModelConfig().scan_layers and not base.get_config("paper").model.scan_layers
  assert not mixers.get_config("paper").model.scan_layers
  assert not mixers.get_config("small").model.scan_layers


# Two periods or more, so the scan runs; the hybrids end with a tail. The routed stacks use the
# cheapest linear mixer to compile (the carry is what they test). The fewest layers that do so
# (the unrolled oracle compiles every layer): "LS" over 3 layers is L S L, two iterations, the
# second skipping the missing softmax; CLER's γ of layer 2 gets its gradient through the carry.
CASES = {
    "softmax": dict(n_layers=2, mixer="softmax", pattern=None),
    "gdn_ls_tail": dict(n_layers=3, pattern="LS"),
    "cler": dict(n_layers=3, mixer="linear_attention", pattern="LS", routing="cler",
                 cler_gamma_init=0.3),
    "clvr": dict(n_layers=3, mixer="linear_attention", pattern="LS", routing="clvr"),
}


# scan_layers is opt-in (off in every config). The default run keeps the equivalence with the
# tail (gdn_ls_tail) and with routing in the carry (cler), the init, the optimisers and the HLO
# size; `-m slow` adds CLVR (whose routed projection CLER's carry test shares the code of), Muon
# beside AdamW, decoding, checkpoint/resume and the context-parallel step (issue #15: suite time).
_SLOW_CASES = {"clvr"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_CASES
                                  else c for c in sorted(CASES)])
def test_scanned_equals_unrolled(case):
  cfg = _config(**CASES[case])
  model = lm.LanguageModel(cfg, rngs=nnx.Rngs(0))
  if cfg.routing in ("cler_h", "clvr"):
    # The routes start at zero; non-zero weights make the routed terms count in the check.
    state = nnx.state(model)
    state = jax.tree.map(lambda x: x + 0.05 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), state)
    nnx.update(model, state)
  scanned = lm.scanned(model)
  assert scanned.config.scan_layers and not hasattr(scanned, "blocks")
  assert jax.tree.leaves(scanned.layer_stack)[0].shape[0] == cfg.scan_rows[0] >= 2
  tokens = _tokens()
  loss_u, logits_u, grads_u = _loss_and_grads(model, tokens)
  loss_s, logits_s, grads_s = _loss_and_grads(scanned, tokens)
  # Bit for bit on CPU (float32): the loop body runs the same ops on the same values.
  np.testing.assert_array_equal(np.asarray(logits_s), np.asarray(logits_u))
  assert float(loss_s) == float(loss_u)
  unstacked = lm.unstack_params(scanned.config, grads_s)
  assert jax.tree.structure(unstacked) == jax.tree.structure(grads_u)
  for (path, g_u), g_s in zip(jax.tree_util.tree_flatten_with_path(grads_u)[0],
                              jax.tree.leaves(unstacked)):
    np.testing.assert_array_equal(np.asarray(g_s), np.asarray(g_u),
                                  err_msg=jax.tree_util.keystr(path))
  if cfg.routing == "cler":  # γ of later linear layers gets a gradient through the carry
    assert float(jnp.abs(grads_u["blocks"][2]["cler"]["gamma"])) > 0


def test_init_stacking_and_sharding_names():
  cfg = _config(n_layers=5, pattern="LS", routing="cler_h")
  scan_cfg = cfg.replace(scan_layers=True)
  unrolled = _pure(lm.LanguageModel(cfg, rngs=nnx.Rngs(3)))
  scanned_model = lm.LanguageModel(scan_cfg, rngs=nnx.Rngs(3))
  stacked = lm.stack_params(scan_cfg, unrolled)
  assert set(stacked) == {"embed", "final_norm", "lm_head", "layer_stack"}
  assert set(stacked["layer_stack"]) == {0, 1}
  assert stacked["layer_stack"][0]["norm1"]["weight"].shape[0] == 3  # layers 0, 2, 4
  assert stacked["layer_stack"][1]["norm1"]["weight"].shape[0] == 2  # layers 1, 3
  jax.tree.map(np.testing.assert_array_equal, _pure(scanned_model), stacked)
  jax.tree.map(np.testing.assert_array_equal, lm.unstack_params(scan_cfg, stacked), unrolled)
  # The trainer's init: one vmapped program per stacked position, the unrolled values stacked.
  got = lm.make_param_init(scan_cfg, 3, compiler_options=COMPILER_OPTIONS)()
  want = lm.stack_params(scan_cfg, lm.make_param_init(cfg, 3, compiler_options=COMPILER_OPTIONS)())
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  # Every stacked parameter: the "layers" name first, then the per-layer names, which the rules
  # replicate (a leading None in the PartitionSpec).
  axes = sharding_lib.nnx_logical_axes(nnx.state(scanned_model, nnx.Param))
  layer_axes = sharding_lib.nnx_logical_axes(nnx.state(lm.LanguageModel(cfg, rngs=nnx.Rngs(3)),
                                                      nnx.Param))
  kernel = axes["layer_stack"][0]["mixer"]["in_proj"]["kernel"]
  assert kernel == ("layers",) + layer_axes["blocks"][0]["mixer"]["in_proj"]["kernel"]
  per_layer = sharding_lib.logical_to_pspec(layer_axes["blocks"][0]["mixer"]["in_proj"]["kernel"])
  assert sharding_lib.logical_to_pspec(kernel) == jax.sharding.PartitionSpec(None, *per_layer)
  with pytest.raises(ValueError, match="blocks"):
    lm.stack_params(scan_cfg, stacked)
  with pytest.raises(ValueError, match="layer_stack"):
    lm.unstack_params(scan_cfg, unrolled)


@pytest.mark.parametrize("name", ["adamw", pytest.param("muon", marks=pytest.mark.slow)])
def test_optimizer_treats_each_stacked_layer_like_the_unrolled_layer(name):
  cfg = _config(n_layers=4, pattern="LS")
  scan_cfg = cfg.replace(scan_layers=True)
  params = _pure(lm.LanguageModel(cfg, rngs=nnx.Rngs(0)))
  grads = jax.tree.map(lambda x: jnp.sin(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape),
                       params)
  settings = dict(name=name, learning_rate=1e-2, total_steps=10, warmup_steps=0)
  tx = optim.make_optimizer(settings)
  # The groups (weight decay, Muon or Adam) are those of the unrolled layers.
  groups = optim.param_groups(lm.stack_params(scan_cfg, params))
  want_groups = optim.param_groups(params)
  for j in range(scan_cfg.scan_period):
    for r in range(scan_cfg.scan_rows[j]):
      assert groups["layer_stack"][j] == want_groups["blocks"][r * scan_cfg.scan_period + j]

  def one_step(p, g):
    updates, _ = tx.update(g, tx.init(p), p)
    return updates

  want = jax.jit(one_step)(params, grads)
  got = jax.jit(one_step)(lm.stack_params(scan_cfg, params), lm.stack_params(scan_cfg, grads))
  # Muon's Newton-Schulz runs batched over the layers axis: rounding-level differences only
  # (updates are ~1e-3; a wrong matrix axis would change them entirely).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               lm.unstack_params(scan_cfg, got), want)


@pytest.mark.slow
def test_decoding_a_scanned_model():
  # Linear attention compiles fastest; the caches' stacking is the subject (GDN's decode is
  # tests/test_decode.py's).
  cfg = _config(n_layers=5, mixer="linear_attention", pattern="LS", routing="cler",
                cler_gamma_init=0.2)
  model = lm.LanguageModel(cfg, rngs=nnx.Rngs(0))
  scanned = lm.scanned(model)
  prompt = _tokens(b=2, t=8)
  want = decode.generate(model, prompt, max_new_tokens=4)
  got = decode.generate(scanned, prompt, max_new_tokens=4)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert len(scanned.init_cache(2, 16)) == cfg.n_layers
  back = lm.unrolled(scanned)
  jax.tree.map(np.testing.assert_array_equal, _pure(back), _pure(model))
  # lineax_attn.inspect walks the unrolled twin: the same per-layer routing summary.
  got_summary, want_summary = inspect.routing_summary(scanned), inspect.routing_summary(model)
  assert [(e["layer"], e["mode"]) for e in got_summary] == [(0, "cler"), (2, "cler"), (4, "cler")]
  for got_entry, want_entry in zip(got_summary, want_summary):
    np.testing.assert_array_equal(got_entry["gamma"], want_entry["gamma"])


def _tiny_run(scan_layers: bool, **train):
  # Linear attention: the subject is the stacked layout of the trainer, checkpoint and resume,
  # not the mixer, and its scanned step compiles in ~2/3 of GDN's (GDN's scanned step is
  # test_scanned_equals_unrolled[gdn_ls_tail]'s).
  config = base.get_config("tiny")
  config.model.update(d_model=32, n_layers=4, pattern="LLS", mlp_hidden=64, chunk_size=16,
                      mixer="linear_attention", scan_layers=scan_layers)
  config.train.update({**dict(global_batch_size=4, seq_len=32, log_every=1, eval_every=0,
                              eval_batches=0, checkpoint_every=3, async_checkpoint=False),
                       **train})
  config.optim.update(warmup_steps=2)
  config.mesh.update(data=1)
  return experiment.resolve(config, device_count=1, process_count=1)


@pytest.mark.slow
def test_train_checkpoint_and_resume(tmp_path):
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  exp = _tiny_run(True, steps=6)
  trainer = loop.Trainer(exp, mesh=mesh, compiler_options=COMPILER_OPTIONS)
  assert "layer_stack" in trainer.param_shardings and "blocks" not in trainer.param_shardings
  unrolled_trainer = loop.Trainer(_tiny_run(False), mesh=mesh)
  spec = lambda t, part, j: (  # noqa: E731
      t.param_shardings[part][j]["mlp"]["up_proj"]["kernel"].spec)
  assert spec(trainer, "layer_stack", 0) == jax.sharding.PartitionSpec(
      None, *spec(unrolled_trainer, "blocks", 0))
  run = lambda workdir, **kw: loop.train(exp, str(workdir), progress=False,  # noqa: E731
                                         trainer=trainer, **kw)
  whole = run(tmp_path / "whole")
  assert whole.losses[-1] < whole.losses[0] - 0.05, whole.losses
  part = run(tmp_path / "split", stop_at_step=3)
  rest = run(tmp_path / "split")
  # The checkpoint at step 3 held the stacked layout: the resumed losses are the unbroken run's.
  assert part.losses + rest.losses == whole.losses
  # An unrolled run in that workdir names the option instead of failing inside orbax.
  with pytest.raises(ValueError, match="scan_layers"):
    loop.train(_tiny_run(False, steps=9), str(tmp_path / "split"), progress=False, mesh=mesh,
               compiler_options=COMPILER_OPTIONS)


def _step_hlo_lines(cfg) -> int:
  """Lines of the optimised HLO of a loss + gradient step (abstract inputs, CPU)."""
  abstract = nnx.eval_shape(lambda: lm.LanguageModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)

  def step(state, tokens):
    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens)
      return losses.masked_cross_entropy(logits, tokens, jnp.ones(tokens.shape))
    return jax.grad(loss)(state)

  compiled = jax.jit(step).lower(state, tokens).compile()
  return len(compiled.as_text().splitlines())


def test_scanned_step_compiles_to_a_much_smaller_program():
  cfg = _config(n_layers=8, mixer="softmax", pattern=None, d_model=16, attn_heads=1,
                attn_kv_heads=1, mlp_hidden=16)
  unrolled, scanned = _step_hlo_lines(cfg), _step_hlo_lines(cfg.replace(scan_layers=True))
  # Measured 2,404 against 7,873 lines (jax 0.11.2): one block in the loop instead of eight.
  assert scanned < 0.4 * unrolled, (scanned, unrolled)


@pytest.mark.slow
def test_context_parallel_step_of_a_scanned_model(monkeypatch):
  """A scanned "LS" hybrid's train step on a (data=2, sequence=4) mesh (the mixers' shard_map
  inside the loop body) equals the unrolled model's step on one device."""
  from lineax_attn import parallel  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import pipeline as pipeline_lib  # pylint: disable=g-import-not-at-top

  def resolve(scan):
    config = base.get_config("tiny")
    config.model.update(d_model=32, n_layers=3, pattern="LS", num_heads=2, num_v_heads=4,
                        head_dim_k=16, head_dim_v=16, attn_heads=2, mlp_hidden=64,
                        chunk_size=16, scan_layers=scan)
    config.train.update(global_batch_size=2, seq_len=64, eval_batches=0)
    config.optim.update(warmup_steps=0, learning_rate=1e-2, eps=1e-3)
    config.mesh.update(data=2, sequence=4)
    return experiment.resolve(config)

  def step(exp, mesh, batch):
    trainer = loop.Trainer(exp, mesh=mesh, compiler_options=COMPILER_OPTIONS)
    params, opt_state = trainer.init()
    params, _, metrics = trainer.step(params, opt_state, trainer.global_batch(batch))
    return float(metrics["loss"]), jax.device_get(params)

  scanned_exp, unrolled_exp = resolve(True), resolve(False)
  batch = next(pipeline_lib.make_iterator(unrolled_exp.train_data, shard_index=0, shard_count=1))
  want_loss, want = step(unrolled_exp, sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                         batch)
  calls = []
  original = parallel.context.sharded_mixer
  monkeypatch.setattr(parallel.context, "sharded_mixer",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  mesh = sharding_lib.make_mesh(*scanned_exp.mesh_shape, sequence=scanned_exp.mesh.sequence)
  got_loss, got = step(scanned_exp, mesh, batch)
  assert calls  # the linear layer ran context parallel
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  # Re-associated float32 sums of the sharded chunks only (measured <= 6e-7 of each leaf's max).
  got = lm.unstack_params(scanned_exp.model, got)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(np.max(np.abs(a - b))) <= 1e-5 * float(np.max(np.abs(b))) + 1e-8


def test_bench_startup_compile_only(tmp_path):
  """experiments/bench_startup.py --compile_only: the step lowered and compiled on abstract
  inputs (nothing initialised or run), with the CPU seconds and HLO lines in the row."""
  import json  # pylint: disable=g-import-not-at-top
  from helpers import FAST_CPU_XLA, run_cpu_python  # pylint: disable=g-import-not-at-top
  out = tmp_path / "startup.json"
  proc = run_cpu_python(
      ["-m", "experiments.bench_startup", "--config=configs/mixers.py:tiny", "--arms=softmax",
       "--compile_only", "--noisolate", "--config.model.scan_layers=true",
       "--config.model.n_layers=3", "--config.train.seq_len=32", f"--json_out={out}"],
      xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (row,) = json.loads(out.read_text())
  assert row["scan_layers"] is True and row["init_compiles"] == 0 and "loss" not in row
  assert row["step_lower_cpu_s"] > 0 and row["step_compile_cpu_s"] > 0
  assert row["step_hlo_lines"] > 100
