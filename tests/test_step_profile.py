"""experiments.step_profile: kernels grouped into kinds by name, and the per-step sums."""

import pytest

from experiments import step_profile


@pytest.mark.parametrize("kernel,kind", [
    ("kernel_mosaic_gpu_kernel [command_buffer_7]", "linear mixer"),
    ("gdr_chunk_grads_mosaic_gpu_kernel [command_buffer_1]", "linear mixer"),
    ("_t0_kernel [triton_kernel_call.0]", "linear mixer"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop [custom-call.3]", "attention"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN [gemm_fusion_dot.12]", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32 [cublas-gemm.1]", "matmul"),
    ("wrapped_transpose_1 [command_buffer_7]", "copy"),
    ("input_convert_reduce_fusion [command_buffer_7]", "fusion"),
    ("loop_add_fusion", "fusion"),
    ("some_unknown_thing", "other"),
])
def test_kernels_fall_into_their_kind(kernel, kind):
  assert step_profile.kind_of(kernel) == kind


def test_by_kind_sums_each_kind_per_step_and_shares_the_total():
  times = {"body_mosaic_gpu_kernel": [100.0, 300.0],       # µs, over 2 steps
           "nvjet_gemm_a": [500.0, 500.0], "sm90_xmma_gemm_b": [100.0],
           "loop_add_fusion": [500.0]}
  rows = step_profile.by_kind(times, steps=2)
  assert [r["kind"] for r in rows] == ["matmul", "fusion", "linear mixer"]
  got = {r["kind"]: (r["kernels"], r["ms"], r["share"]) for r in rows}
  assert got["matmul"] == (2, pytest.approx(0.55), pytest.approx(1100 / 2000))
  assert got["linear mixer"] == (1, pytest.approx(0.2), pytest.approx(0.2))
  assert got["fusion"] == (1, pytest.approx(0.25), pytest.approx(0.25))


_HLO = """HloModule jit__train_step

FileNames
1 "/usr/lib/python3.12/site-packages/flax/nnx/nn/linear.py"
2 "/home/me/lineax/lineax_attn/models/lm.py"

FunctionNames
1 "__call__"
2 "hidden_states"

FileLocations
1 {file_name_id=1 function_name_id=1 line=422 end_line=422 column=1 end_column=9}
2 {file_name_id=2 function_name_id=2 line=210 end_line=210 column=5 end_column=70}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

%fused_computation (param_0: bf16[4,24]) -> f32[4,1,24] {
  ROOT %convert.0 = f32[4,24]{1,0} convert(%param_0)
}

ENTRY %main (p0: f32[50,24], p1: s32[4]) -> f32[50,24] {
  %input_scatter_fusion.1 = f32[50,24]{1,0} fusion(%p0, %p1), kind=kInput, calls=%fused_computation, metadata={op_name="jit(_train_step)/transpose(jvp())/scatter-add" stack_frame_id=2}
  ROOT %tuple.3 = (f32[50,24]{1,0}, bf16[4]{0}) tuple(%input_scatter_fusion.1, %p1)
}
"""


def test_hlo_instructions_name_a_kernel_its_output_and_our_source_line():
  # A fusion's kernel carries its name with "." as "_"; its metadata's stack frame resolves,
  # through the parent chain (printed as the parent's id + 1), to the innermost line of this
  # repository's code: lm.py:210, not flax's linear.py:422 that the frame itself points at.
  found = step_profile.hlo_instructions(_HLO)
  assert found["input_scatter_fusion_1"] == (
      "f32[50,24]", "fusion", "scatter-add @ lineax_attn/models/lm.py:210")
  assert found["tuple_3"][:2] == ("(f32[50,24], bf16[4])", "tuple")
  assert found["convert_0"] == ("f32[4,24]", "convert", "")
  assert step_profile._instruction_cells("input_scatter_fusion.1 [command_buffer_3]", found) == {
      "output": "f32[50,24] fusion", "op": "scatter-add @ lineax_attn/models/lm.py:210"}
  assert step_profile._instruction_cells("body_mosaic_gpu_kernel", found) == {"output": "",
                                                                             "op": ""}
