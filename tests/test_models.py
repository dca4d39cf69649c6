"""Tests of the models (lineax_attn.models): stack resolution, configuration errors, the 350M
parameter counts of docs/MATH.md §4.5, a training step through every mixer and a routing mode,
zero-initialised routing = baseline (docs/MATH.md §9 item 16), causality (item 17), packing =
separate at the model level (item 3) and sharding the parameters by their logical axis names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lineax_attn.layers import LINEAR_MIXERS, partition
from lineax_attn.models import LanguageModel, ModelConfig, get_config
from lineax_attn.models import params as params_lib
from helpers import assert_close, rel_err

EVERY_MIXER = ",".join(LINEAR_MIXERS + ("softmax",))   # every layer kind a model can hold
N_EVERY = len(LINEAR_MIXERS) + 1


def small_config(**overrides) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, n_layers=3, mixer="gdn", pattern="LSL", num_heads=2,
              num_v_heads=4, head_dim_k=8, head_dim_v=8, attn_heads=4, attn_kv_heads=2,
              mlp_hidden=64, chunk_size=16)
  return ModelConfig(**{**base, **overrides})


def _tokens(b, t, seed=0, vocab=64):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, jnp.int32)


# ------------------------------------------------------------------------------------------
# The stack from a config.


def test_layer_types_from_frequency_and_patterns():
  freq3 = get_config("gdn_350m").layer_types
  # docs/MATH.md §6.2: N = 3 on 20 layers puts SDPA at 2, 5, 8, 11, 14, 17 (14 GDN + 6 SDPA).
  assert [i for i, k in enumerate(freq3) if k == "softmax"] == [2, 5, 8, 11, 14, 17]
  assert freq3.count("gdn") == 14
  assert ModelConfig(n_layers=20, pattern="LLS").layer_types == freq3
  three_to_one = ModelConfig(n_layers=20, pattern="LLLS", mixer="kda").layer_types
  assert three_to_one.count("softmax") == 5 and three_to_one.count("kda") == 15
  assert ModelConfig(n_layers=20, mixer="kda", linear_attention_freq=4).layer_types == three_to_one
  assert ModelConfig(n_layers=4, mixer="deltanet").layer_types == ("deltanet",) * 4
  assert ModelConfig(n_layers=3, mixer="sdpa").layer_types == ("softmax",) * 3
  assert ModelConfig(n_layers=4, pattern="gated_delta_rule,attention").layer_types == (
      "gdn", "softmax", "gdn", "softmax")
  explicit = ("kda", "gdn2", "softmax")
  assert ModelConfig(n_layers=3, pattern=explicit).layer_types == explicit
  # The 350M presets' attention gate follows the repo: on with GDN, off with DeltaNet/softmax.
  assert get_config("gdn_350m").attention_output_gate
  assert not get_config("deltanet_350m").attention_output_gate


@pytest.mark.parametrize("overrides, match", [
    (dict(pattern="gdn,mamba,softmax"), "unknown mixer 'mamba'"),
    (dict(mixer="retnet"), "unknown mixer"),
    (dict(pattern="LLX"), "unknown letters"),
    (dict(pattern=("gdn", "softmax")), "one mixer per layer"),
    (dict(pattern="LLS", linear_attention_freq=3), "at most one"),
    (dict(d_model=30, num_heads=4, head_dim_k=None), "not divisible by num_heads"),
    (dict(d_model=36, num_heads=4, head_dim_k=8, attn_heads=8), "not divisible by attn_heads"),
    (dict(num_heads=4, num_v_heads=6), "multiple of num_heads"),
    (dict(attn_heads=4, attn_kv_heads=3), "GQA"),
    (dict(mixer="softmax", pattern=None, routing="clvr"), "needs at least one linear layer"),
    (dict(mixer="softmax", pattern="LLS"), "needs `mixer` to name a linear mixer"),
    (dict(routing="cler-v"), "routing must be one of"),
    (dict(cler_gamma="matrix"), "cler_gamma"),
    (dict(output_gate="tanh"), "output_gate"),
    (dict(chunk_size=24), "chunk_size"),
    (dict(n_layers=0), "n_layers"),
    (dict(dtype="float33"), "dtype"),
])
def test_bad_model_configurations_raise(overrides, match):
  with pytest.raises(ValueError, match=match):
    small_config(**overrides)


def test_model_rejects_a_non_config():
  with pytest.raises(ValueError, match="ModelConfig"):
    LanguageModel({"d_model": 32}, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------------------
# Parameter counts of the 350M presets (docs/MATH.md §4.5, §9 item 19), within 2 %.


@pytest.mark.parametrize("preset, total, non_embedding", [
    ("gdn_350m", 290.3e6, 224.7e6),
    ("deltanet_350m", 276.5e6, 210.9e6),
    ("softmax_350m", 317.2e6, None),
])
def test_350m_parameter_counts_match_the_paper(preset, total, non_embedding):
  model = params_lib.abstract_model(get_config(preset))
  print(f"\n{preset}\n{params_lib.format_breakdown(model)}")
  breakdown = params_lib.param_breakdown(model)
  assert abs(breakdown["total"] / total - 1) < 0.02
  if non_embedding is not None:
    assert abs(breakdown["non_embedding"] / non_embedding - 1) < 0.02
  assert breakdown["embedding"] == breakdown["lm_head"] == 32_000 * 1024  # untied
  assert sum(sum(v for k, v in layer.items() if k != "kind") for layer in breakdown["layers"]) \
      + breakdown["embedding"] + breakdown["lm_head"] + breakdown["final_norm"] == breakdown["total"]


def test_hidden_routing_adds_one_projection_per_linear_layer():
  # docs/MATH.md §4.5: CLVR and CLER-H add 512 × 1024 per linear layer, 7,340,032 over 14 layers.
  base = params_lib.count_params(params_lib.abstract_model(get_config("gdn_350m")))
  for mode in ("clvr", "cler_h"):
    routed = params_lib.count_params(params_lib.abstract_model(get_config("gdn_350m", routing=mode)))
    assert routed - base == 7_340_032
  low_rank = get_config("gdn_350m", routing="clvr", routing_rank=64)
  assert params_lib.count_params(params_lib.abstract_model(low_rank)) - base == 14 * 64 * (512 + 1024)
  tied = get_config("gdn_350m", tie_embeddings=True)
  assert base - params_lib.count_params(params_lib.abstract_model(tied)) == 32_000 * 1024


# ------------------------------------------------------------------------------------------
# One model with every mixer and a routing mode trains on CPU (the chunk form's backward).


def test_training_steps_through_every_mixer_with_routing():
  config = small_config(n_layers=N_EVERY, pattern=EVERY_MIXER, routing="clvr", tie_embeddings=True,
                        implementation="chunk")
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  tokens = _tokens(2, 24)

  @nnx.jit
  def train_step(model, optimizer, tokens):
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads

  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  losses = []
  for _ in range(3):
    loss, grads = train_step(model, optimizer, tokens)
    losses.append(float(loss))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      assert np.all(np.isfinite(g)), f"non-finite gradient at {jax.tree_util.keystr(path)}"
  assert abs(losses[0] - np.log(64)) < 0.5  # near-uniform predictions at init
  assert losses[-1] < losses[0] - 0.05, losses
  after = nnx.state(model, nnx.Param)
  changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
  assert all(changed), "every parameter should move after three AdamW steps"


# ------------------------------------------------------------------------------------------
# Zero-initialised routing starts at the baseline (docs/MATH.md §9 item 16).

_ROUTING_PARAMS = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("cler"), nnx.PathContains("route")))


@nnx.jit
def _logits_and_routing_grads(model, tokens):
  def loss_fn(model):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, _ROUTING_PARAMS))(model)
  return model(tokens), grads


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


# CLER-H at full rank is CLVR's projection fed with r instead of v: its full-rank case is covered
# by CLVR here and by the CLER-H decode test; CLER-H is tested at low rank.
@pytest.mark.parametrize("routing, rank", [("cler", None), ("cler_h", 4), ("clvr", None)])
def test_zero_init_routing_equals_the_baseline(routing, rank):
  # "LSL": CLER v1 carries the first GDN layer's residual across the softmax layer.
  config = small_config(implementation="scan")
  tokens = _tokens(2, 20)
  baseline = LanguageModel(config, rngs=nnx.Rngs(0))
  routed = LanguageModel(config.replace(routing=routing, routing_rank=rank), rngs=nnx.Rngs(1))
  nnx.update(routed, nnx.state(baseline, nnx.Param))  # same weights, routing at its init
  logits, grads = _logits_and_routing_grads(routed, tokens)
  np.testing.assert_allclose(logits, _logits(baseline, tokens), rtol=0, atol=1e-6)

  first, second = routed.blocks[0], routed.blocks[2]
  g_first, g_second = grads["blocks"][0], grads["blocks"][2]
  if routing == "cler":
    assert float(first.cler.gamma[...]) == 0.0 and float(second.cler.gamma[...]) == 0.0
    assert float(g_first["cler"]["gamma"][...]) == 0.0     # γ multiplies 0 in the first layer
    assert abs(float(g_second["cler"]["gamma"][...])) > 1e-7
  elif rank is None:
    for g in (g_first, g_second):
      assert float(jnp.max(jnp.abs(g["route"]["proj"]["kernel"][...]))) > 0
  else:  # low rank: the zero second factor learns, the first factor's gradient is exactly 0
    for block, g in ((first, g_first), (second, g_second)):
      assert float(jnp.max(jnp.abs(block.route.up.kernel[...]))) == 0.0
      assert float(jnp.max(jnp.abs(g["route"]["up"]["kernel"][...]))) > 0
      assert float(jnp.max(jnp.abs(g["route"]["down"]["kernel"][...]))) == 0.0


def perturb_routing(model: LanguageModel, key) -> None:
  """Gives every routing parameter a non-zero value so the routed paths carry signal."""
  for i, block in enumerate(model.blocks):
    k = jax.random.fold_in(key, i)
    if hasattr(block, "cler"):
      block.cler.gamma[...] = jnp.full(block.cler.gamma[...].shape, 0.5)
    if hasattr(block, "route"):
      for j, (_, var) in enumerate(nnx.iter_graph(block.route)):
        if isinstance(var, nnx.Param):
          var[...] = 0.2 * jax.random.normal(jax.random.fold_in(k, j), var[...].shape)


# ------------------------------------------------------------------------------------------
# Causality (item 17) and packing = separate (item 3), through every mixer, conv and routing.


def test_causality_and_packing_through_the_whole_model():
  config = small_config(n_layers=N_EVERY, pattern=EVERY_MIXER, routing="cler",
                        implementation="chunk")
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  perturb_routing(model, jax.random.key(5))
  t, t0, la = 24, 11, 10
  tok = _tokens(1, t, seed=1)[0]
  changed = tok.at[t0].set((tok[t0] + 7) % 64)
  other = _tokens(1, t, seed=2)[0]
  # Rows: tokens; tokens changed at t0; [tok[:la] | other[:t-la]] packed as two segments;
  # the two segments alone, each followed by padding.
  packed = jnp.concatenate([tok[:la], other[:t - la]])
  alone_a = jnp.concatenate([tok[:la], jnp.zeros(t - la, jnp.int32)])
  rows = jnp.stack([tok, changed, packed, alone_a, other])
  ones = jnp.ones(t, jnp.int32)
  segs = jnp.stack([ones, ones, jnp.where(jnp.arange(t) < la, 1, 2),
                    jnp.where(jnp.arange(t) < la, 1, 0), jnp.where(jnp.arange(t) < t - la, 1, 0)])
  logits = nnx.jit(lambda m, x, s: m(x, s))(model, rows, segs)

  np.testing.assert_allclose(logits[1, :t0], logits[0, :t0], rtol=0, atol=1e-5)
  for s in range(t0, t):
    assert rel_err(logits[1, s], logits[0, s]) > 1e-4, f"position {s} ignores token {t0}"
  assert_close(logits[2, :la], logits[3, :la], 1e-5, "packed segment 1")
  assert_close(logits[2, la:], logits[4, :t - la], 1e-5, "packed segment 2")


# ------------------------------------------------------------------------------------------
# Logical axis names: a mesh rule table shards the parameters without touching the layers.


def test_parameters_shard_by_logical_axis_names():
  config = small_config(pattern="LS", n_layers=2, implementation="scan")
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  specs = nnx.get_partition_spec(state)
  vocabulary = {partition.EMBED, partition.VOCAB, partition.MLP, partition.HEADS, partition.CONV,
                partition.RANK, None}
  for (path, value), (_, spec) in zip(jax.tree_util.tree_leaves_with_path(state),
                                      jax.tree_util.tree_leaves_with_path(specs)):
    assert len(spec) == value.ndim, f"{jax.tree_util.keystr(path)}: {spec} for shape {value.shape}"
    assert set(spec) <= vocabulary, f"{jax.tree_util.keystr(path)}: {spec}"
  embed_spec = nnx.get_partition_spec(nnx.state(model.embed))["embedding"]
  assert tuple(embed_spec.get_value()) == ("vocab", "embed")

  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  rules = {"embed": "fsdp", "vocab": "tensor", "mlp": "tensor", "heads": "tensor"}
  to_mesh = lambda spec: NamedSharding(mesh, PartitionSpec(*[rules.get(a) for a in spec]))
  shardings = jax.tree.map(to_mesh, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  sharded = jax.device_put(state, shardings)
  kernel = sharded["blocks"][0]["mixer"]["in_proj"]["kernel"][...]
  assert kernel.sharding.spec == PartitionSpec("fsdp", "tensor")
  assert len(kernel.addressable_shards) == 8

  tokens = _tokens(2, 16)
  graphdef = nnx.graphdef(model)
  forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  np.testing.assert_allclose(forward(sharded, tokens), forward(state, tokens), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# make_param_init / init_params: the model's parameters, one compiled program per block kind
# (issue #15).


def _one_program_init(config, seed):
  """The oracle: the whole model's construction as one jitted program (the trainer's former
  init), so both sides run the initialisers compiled."""
  return jax.jit(lambda: nnx.to_pure_dict(
      nnx.state(LanguageModel(config, rngs=nnx.Rngs(seed)), nnx.Param)))()


@pytest.mark.parametrize("overrides", [
    dict(routing="cler_h", routing_rank=4),
    dict(mixer="kda", routing="cler", tie_embeddings=True),
], ids=["gdn-cler_h-untied", "kda-cler-tied"])
@pytest.mark.usefixtures("fresh_compiles")   # (it counts XLA's own compiles)
def test_init_params_equals_the_model_one_compile_per_block_kind(overrides):
  from lineax_attn.models import lm  # pylint: disable=g-import-not-at-top
  config = small_config(n_layers=4, **overrides)  # "LSL" over 4 layers: L S L L
  compiled = []
  listener = lambda event, seconds, **_: compiled.append(event) if event == (  # noqa: E731
      "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  init = lm.make_param_init(config, 3)
  try:
    params = init()
    # One program for the embedding, norm, head and keys, one per block kind; not one per block.
    assert len(compiled) == 1 + len(set(config.layer_types)) == 3
    again = init()
    assert len(compiled) == 3  # the function keeps its programs
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)

  oracle = _one_program_init(config, 3)
  assert jax.tree.structure(params) == jax.tree.structure(oracle)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params),
                               jax.tree.leaves(oracle)):
    np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
  # Blocks of one kind get different keys: their random weights differ.
  w = lambda i: params["blocks"][i]["mlp"]["up_proj"]["kernel"]  # noqa: E731
  assert not np.array_equal(w(2), w(3))


def test_init_params_creates_each_piece_in_its_sharding():
  """(The values do not depend on the sharding: tests/test_train_sharded.py.)"""
  from lineax_attn.models import lm  # pylint: disable=g-import-not-at-top
  config = small_config(n_layers=2)
  abstract = nnx.state(params_lib.abstract_model(config), nnx.Param)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  rules = {"embed": "fsdp", "vocab": "tensor", "mlp": "tensor", "heads": "tensor"}
  specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract))
  shardings = jax.tree.map(
      lambda spec: NamedSharding(mesh, PartitionSpec(*[rules.get(a) for a in spec])), specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec))
  params = lm.init_params(config, 0, out_shardings=shardings)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params),
                               jax.tree.leaves(shardings)):
    assert got.sharding == want, jax.tree_util.keystr(path)
  assert params["embed"]["embedding"].sharding.spec == PartitionSpec("tensor", "fsdp")


@pytest.mark.parametrize("config, seed, match", [
    ("not a config", 0, "config must be a ModelConfig"),
    (None, 1.5, "seed must be an int"),
    (None, True, "seed must be an int"),
])
def test_make_param_init_rejects_bad_arguments(config, seed, match):
  from lineax_attn.models import lm  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=match):
    lm.make_param_init(small_config() if config is None else config, seed)


def test_make_param_init_rejects_shardings_without_every_block():
  from lineax_attn.models import lm  # pylint: disable=g-import-not-at-top
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = {"embed": {"embedding": one}, "final_norm": {"weight": one},
               "blocks": {0: {}, 1: {}}}
  with pytest.raises(ValueError, match="out_shardings must have 'blocks' with an entry for each "
                     "of the 3 blocks, got \\[0, 1\\]"):
    lm.make_param_init(small_config(), 0, out_shardings=shardings)


def test_embed_tokens_keeps_the_rows_and_makes_a_float32_table_gradient():
  # The embedding's rows are the table's, cast; their VJP is the one-hot product computed here
  # in float32 at HIGHEST (repeated tokens add up), and the compiled gradient is a float32
  # scatter-add (a bf16 one, what nnx.Embed's cast-first lookup makes, is slow on a GPU).
  from lineax_attn.models.lm import embed_tokens
  table = jax.random.normal(jax.random.key(0), (50, 24), jnp.float32)
  tokens = jnp.array([[3, 7, 3, 49], [0, 3, 7, 7]])
  rows = jax.jit(embed_tokens, static_argnums=2)(table, tokens, jnp.bfloat16)
  assert rows.dtype == jnp.bfloat16
  assert jnp.array_equal(rows, table[tokens].astype(jnp.bfloat16))
  ct = jax.random.normal(jax.random.key(1), (2, 4, 24)).astype(jnp.bfloat16)
  vjp = jax.jit(lambda t, c: jax.vjp(lambda t: embed_tokens(t, tokens, jnp.bfloat16), t)[1](c))
  (got,) = vjp(table, ct)
  onehot = jax.nn.one_hot(tokens.reshape(-1), 50, dtype=jnp.float32)
  want = jnp.matmul(onehot.T, ct.reshape(-1, 24).astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  hlo = vjp.lower(table, ct).compile().as_text()
  scatters = [line for line in hlo.splitlines() if " scatter(" in line]
  assert scatters and all("f32[50,24]" in line for line in scatters), scatters
