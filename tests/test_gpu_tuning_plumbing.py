"""`GpuTuning` from the command line to the op: parsing, ModelConfig, the layer and the model.

Which pair-matrix path a trace takes is visible in its jaxpr (the Pallas kernel's custom-VJP
name `channel_pairs_kernel` versus XLA's `_channel_pair`), so these tests check that a tuning
really reaches the op, on CPU, through the Mosaic GPU / Triton interpreters.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from lineax_attn import ops
from lineax_attn.layers import LinearMixer
from lineax_attn.models import LanguageModel, ModelConfig


def test_parse_reads_fields_and_keeps_the_rest_default():
  assert ops.GpuTuning.parse("") == ops.GpuTuning()
  assert ops.GpuTuning.parse("remat_intra=false, channel_pair=kernel") == ops.GpuTuning(
      remat_intra=False, channel_pair="kernel")
  assert ops.GpuTuning.parse("remat_intra=True").remat_intra is True
  assert ops.GpuTuning.parse("channel_span=80").channel_span == 80.0
  assert ops.GpuTuning().channel_span == 80.0         # the bounded-span path by default
  assert ops.GpuTuning.parse("approx_math=false").approx_math is False
  assert ops.GpuTuning().approx_math is True           # ex2.approx in chunk_grads by default
  assert ops.GpuTuning.parse("join_exit=false").join_exit is False
  assert ops.GpuTuning().join_exit is True             # timed faster on the H200: the default
  assert ops.GpuTuning.parse("grads_warpgroups=1").grads_warpgroups == 1
  assert ops.GpuTuning().grads_warpgroups == 2         # timed faster on the H200: the default
  assert ops.GpuTuning.parse("maps_chains=2").maps_chains == 2
  assert ops.GpuTuning().maps_chains == 0              # the waves decide (`gpu_pieces`)
  assert ops.GpuTuning.parse("walk_overlap=true").walk_overlap is True
  assert ops.GpuTuning().walk_overlap is False         # on once the compiled suite has run so
  assert ops.GpuTuning.parse("channel_solve=kernel").channel_solve == "kernel"
  assert ops.GpuTuning().channel_solve == "prefetched"  # timed faster on an H100 (2026-12-07)


def test_channel_solve_choices_are_the_kernels_own():
  # GpuTuning spells the choices without importing the kernels; they must stay the same.
  from lineax_attn.ops import gpu_tuning  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gpu.triton import blocks  # pylint: disable=g-import-not-at-top
  assert gpu_tuning.CHANNEL_SOLVE_CHOICES == blocks.CHANNEL_SOLVES
  assert ops.GpuTuning().channel_solve == blocks.CHANNEL_SOLVE


@pytest.mark.parametrize("text, match", [
    ("remat=false", "remat=false"),            # unknown field
    ("remat_intra", "field=value"),            # no value
    ("remat_intra=0", "true or false"),        # not a bool word
    ("channel_pair=fast", "channel_pair"),     # checked by GpuTuning itself
    ("channel_span=wide", "a number"),         # not a number
    ("channel_span=81", r"\[0, 80\]"),          # past e^80's bound
    ("channel_span=-1", r"\[0, 80\]"),
    ("approx_math=yes", "true or false"),
    ("join_exit=1", "true or false"),
    ("walk_overlap=on", "true or false"),
    ("grads_warpgroups=two", "an integer"),
    ("grads_warpgroups=3", "1 or 2"),
    ("maps_chains=3", "0 \\(auto\\), 1 or 2"),
    ("channel_solve=split", "channel_solve"),
])
def test_parse_rejects_bad_text(text, match):
  with pytest.raises(ValueError, match=match):
    ops.GpuTuning.parse(text)


def test_int_fields_refuse_floats_and_bools():
  # 2.0 == 2 would pass a membership test alone.
  for name in ("grads_warpgroups", "maps_chains", "row_pieces"):
    for bad in (2.0, True):
      with pytest.raises(ValueError, match=name):
        ops.GpuTuning(**{name: bad})


def test_model_config_stores_a_tuning_and_names_the_field_on_error():
  assert ModelConfig(gpu_tuning="remat_intra=false").gpu_tuning == ops.GpuTuning(remat_intra=False)
  assert ModelConfig(gpu_tuning=ops.GpuTuning(solve="trsm")).gpu_tuning.solve == "trsm"
  assert ModelConfig().gpu_tuning is None
  with pytest.raises(ValueError, match="gpu_tuning"):
    ModelConfig(gpu_tuning="intra=fast")
  config = ModelConfig(gpu_tuning="channel_pair=kernel")
  assert ModelConfig(**dataclasses.asdict(config)) == config      # asdict round trip
  with pytest.raises(ValueError, match="gpu_tuning"):
    ModelConfig(gpu_tuning={"remat": False})
  with pytest.raises(ValueError, match="gpu_tuning"):
    ModelConfig(gpu_tuning=3)
  with pytest.raises(ValueError, match="gpu_tuning"):
    LinearMixer("kda", 64, num_heads=1, gpu_tuning="remat_intra=false", rngs=nnx.Rngs(0))


def _pair_paths(module, x):
  graph, state = nnx.split(module)
  text = str(jax.make_jaxpr(lambda s, x: nnx.merge(graph, s)(x))(state, x))
  names = set(re.findall(r"name=(\w+)", text))
  return {"kernel": "channel_pairs_kernel" in names, "xla": "_channel_pair" in names}


def test_the_layer_passes_its_tuning_to_pallas_gpu_only():
  x = jax.random.normal(jax.random.key(0), (1, 64, 64))
  make = lambda impl, t: LinearMixer("kda", 64, num_heads=1, implementation=impl, gpu_tuning=t,
                                     rngs=nnx.Rngs(0))
  # (channel_intra="xla": where the triton extra runs, "auto" takes the Triton channel kernels,
  # which make no pairs at all.)
  plain = ops.GpuTuning(channel_intra="xla")
  assert _pair_paths(make("pallas_gpu", plain), x) == {"kernel": False, "xla": True}
  kernel = ops.GpuTuning(channel_intra="xla", channel_pair="kernel")
  assert _pair_paths(make("pallas_gpu", kernel), x) == {"kernel": True, "xla": False}
  # Another implementation takes no tuning: the layer drops it, and the output is unchanged.
  forward = nnx.jit(lambda m, x: m(x))  # one compile per layer, not one per primitive
  y_tuned, y_plain = forward(make("chunk", kernel), x), forward(make("chunk", None), x)
  assert _pair_paths(make("chunk", kernel), x)["kernel"] is False
  assert jnp.array_equal(y_tuned, y_plain)


def test_the_model_builds_its_linear_layers_with_the_config_tuning():
  config = ModelConfig(mixer="kda", pattern="LS", n_layers=2, d_model=64, num_heads=1,
                       attn_heads=1, gpu_tuning="channel_pair=kernel,remat_intra=false")
  model = LanguageModel(config, rngs=nnx.Rngs(0))
  mixers = [b.mixer for b in model.blocks if isinstance(b.mixer, LinearMixer)]
  assert mixers and all(m.gpu_tuning == ops.GpuTuning(channel_pair="kernel", remat_intra=False)
                        for m in mixers)


def test_channel_grads_auto_resolves_per_kernels_path():
  # GpuTuning.channel_grads "auto" (the default): the kernels and the state pass under one VJP
  # ("states", timed fastest on pallas_gpu's Mosaic path, 2026-12-06) there; the fused
  # backward kernel ("kernel") on the triton implementation's path, where "states" is untimed.
  # Named choices are kept on both paths.
  from lineax_attn.ops.gpu_tuning import channel_grads_choice
  assert ops.GpuTuning().channel_grads == "auto"
  assert channel_grads_choice(ops.GpuTuning(), "mosaic") == "states"
  assert channel_grads_choice(ops.GpuTuning(), "triton") == "kernel"
  for named in ("xla", "kernel", "states"):
    for kernels in ("mosaic", "triton"):
      assert channel_grads_choice(ops.GpuTuning(channel_grads=named), kernels) == named


def test_state_products_choice_is_checked_and_needs_the_triton_extra():
  # GpuTuning.state_products: "auto" (default: the reverse pass's own where it can run, K =
  # V = 64 on the Mosaic pass; else the Triton kernel where the extra runs, else XLA's), "xla"
  # or "kernel"; "kernel" asked for by name where the extra cannot run is refused rather than
  # silently replaced.
  from lineax_attn.ops import pallas_gpu, triton_gpu
  assert ops.GpuTuning().state_products == "auto"
  assert ops.GpuTuning.parse("state_products=kernel").state_products == "kernel"
  with pytest.raises(ValueError, match="state_products"):
    ops.GpuTuning(state_products="cuda")
  with pytest.raises(ValueError, match="needs channel_grads='states'"):
    ops.GpuTuning(state_products="channel")       # (the channel kernel's own products)
  assert ops.GpuTuning(channel_grads="states", state_products="channel").state_products == (
      "channel")
  assert pallas_gpu.state_products(ops.GpuTuning(state_products="xla")) == "xla"
  assert pallas_gpu.state_products(ops.GpuTuning()) == (
      "kernel" if triton_gpu.available() else "xla")          # (no sizes: not the pass's)
  for state, dk, dv in (("mosaic", 128, 128), ("mosaic", 64, 128), ("triton", 64, 64)):
    assert pallas_gpu.state_products(ops.GpuTuning(), state, dk, dv) == (
        "kernel" if triton_gpu.available() else "xla"), (state, dk, dv)
  assert pallas_gpu.state_products(ops.GpuTuning(), "mosaic", 64, 64) == "pass"
  asked = ops.GpuTuning(state_products="kernel")
  if triton_gpu.available():
    assert pallas_gpu.state_products(asked) == "kernel"
  else:
    with pytest.raises(ValueError, match="state_products='xla'"):
      pallas_gpu.state_products(asked)


def test_state_products_in_the_pass_only_where_a_cta_holds_all_of_v():
  # "pass": the Mosaic reverse pass makes the products, only at K = V = 64 (one CTA holds all
  # of V, over which every product sums) and only on the Mosaic pass; elsewhere it is refused
  # with the reason, not replaced.
  from lineax_attn.ops import pallas_gpu
  asked = ops.GpuTuning.parse("state_products=pass")
  assert pallas_gpu.state_products(asked, "mosaic", 64, 64) == "pass"
  for dk, dv in ((128, 128), (64, 128), (128, 64)):
    with pytest.raises(ValueError, match="K = V = 64"):
      pallas_gpu.state_products(asked, "mosaic", dk, dv)
  with pytest.raises(ValueError, match="Mosaic state pass"):
    pallas_gpu.state_products(asked, "triton", 64, 64)


def test_state_pass_choice_is_checked_and_needs_the_triton_extra():
  # GpuTuning.state_pass: "mosaic" (default) or "triton"; anything else is refused by name. The
  # Triton path runs its own state pass whatever the field says; the Mosaic path refuses the
  # Triton one where the extra cannot run (here: no CUDA GPU) rather than fall back silently.
  from lineax_attn.ops import pallas_gpu, triton_gpu
  assert ops.GpuTuning().state_pass == "mosaic"
  assert ops.GpuTuning.parse("state_pass=triton").state_pass == "triton"
  with pytest.raises(ValueError, match="state_pass"):
    ops.GpuTuning(state_pass="cuda")
  triton_asked = ops.GpuTuning(state_pass="triton")
  assert pallas_gpu.state_kernels(ops.GpuTuning(), "mosaic") == "mosaic"
  assert pallas_gpu.state_kernels(triton_asked, "triton") == "triton"
  assert pallas_gpu.state_kernels(ops.GpuTuning(), "triton") == "triton"
  if triton_gpu.available():
    assert pallas_gpu.state_kernels(triton_asked, "mosaic") == "triton"
  else:
    with pytest.raises(ValueError, match="state_pass='mosaic'"):
      pallas_gpu.state_kernels(triton_asked, "mosaic")


def test_forward_choice_is_checked_and_needs_the_triton_extra():
  # GpuTuning.forward: "auto" (default), "split", "walk" or "fused"; "fused" runs Triton
  # kernels on either GPU implementation, so without the extra (here: no CUDA GPU) it is
  # refused, never dropped. ("auto" / "walk": tests/test_chunk_walk.py.)
  from lineax_attn.ops import pallas_gpu, triton_gpu
  assert ops.GpuTuning().forward == "auto"
  assert ops.GpuTuning.parse("forward=fused").forward == "fused"
  assert ops.GpuTuning.parse("forward=walk").forward == "walk"
  with pytest.raises(ValueError, match="forward"):
    ops.GpuTuning(forward="fast")
  fused = ops.GpuTuning(forward="fused")
  assert not pallas_gpu.fused_forward_applies(ops.GpuTuning(), 128, 128, 64)
  if triton_gpu.available():
    assert pallas_gpu.fused_forward_applies(fused, 128, 128, 64)
    assert not pallas_gpu.fused_forward_applies(fused, 256, 128, 64)  # K > 128: the split
  else:
    with pytest.raises(ValueError, match="forward='split'"):
      pallas_gpu.fused_forward_applies(fused, 128, 128, 64)
