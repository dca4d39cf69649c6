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
