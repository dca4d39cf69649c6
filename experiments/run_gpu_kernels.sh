#!/bin/bash
# Device-side runner for the pallas_gpu work: compiled kernel tests, then the kernel benchmark.
# Usage (repo root, on the GPU machine, wheels carried in .whl/): bash experiments/run_gpu_kernels.sh TEST_TIMEOUT BENCH_TIMEOUT [bench flags...]
# Env: GPU_TESTS (default: both GPU kernel test files; paths only, split on spaces), GPU_TEST_K
# (a pytest -k expression, spaces allowed); MOSAIC_GPU_DUMP_PTXAS=1 makes the bench log
# ptxas's report (registers, spills) of every Mosaic GPU kernel it compiles; bench flag
# --profile_dir=/tmp/prof (with --breakdown) logs the intra-chunk kernels' time per phase;
# TRITON_PTXAS=1 keeps the PTX of every Triton kernel jax-triton compiles (JAX_TRITON_DUMP_DIR;
# jax-triton ignores TRITON_KERNEL_DUMP) and writes ptxas's report (registers, spills) of each
# to $OUT/ptxas.txt.
set -u
TT=${1:-240}; BT=${2:-300}; shift 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/jax_linear_attention-*.whl .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl \
  .whl/einops-*.whl .whl/jax_triton-*.whl > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
# FLA_GDN2_PATCH=1 (timing only): fla-core 0.6.0's GDN-2 backward does not compile on triton 3.6
# (`tl.dot` of the bf16 dv with the float32 w_gate * v in chunk_gdn2_bwd_kernel_wy_dqkg_fused);
# cast the product to dv's dtype, as the same kernel gets when w_gate is bf16.
if [ "${FLA_GDN2_PATCH:-0}" = 1 ]; then
  f=/tmp/site/fla/ops/gdn2/chunk_bwd.py
  sed -i 's/tl.dot(b_dv, tl.trans(b_v \* b_wg), b_dA)/tl.dot(b_dv, tl.trans((b_v * b_wg).to(b_dv.dtype)), b_dA)/' $f
  grep -q "(b_v \* b_wg).to(b_dv.dtype)" $f && echo "FLA GDN-2 backward patched (timing only)" || echo "FLA GDN-2 patch did not apply"
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache JAX_PLATFORMS=cuda
mkdir -p /tmp/triton_cache
[ "${TRITON_PTXAS:-0}" = 1 ] && export JAX_TRITON_DUMP_DIR=/tmp/jtdump && mkdir -p /tmp/jtdump
[ -f .whl/triton_cache.tgz ] && tar xzf .whl/triton_cache.tgz -C /tmp/triton_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
if [ "$TT" -gt 0 ]; then
  timeout $TT env -u MOSAIC_GPU_DUMP_PTXAS python3 -m pytest ${GPU_TESTS:-tests/test_pallas_gpu.py tests/test_pallas_gpu_intra.py} ${GPU_TEST_K:+-k "$GPU_TEST_K"} -m "slow or not slow" -v -p no:cacheprovider --durations=10 > $OUT/test_gpu.log 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" $OUT/test_gpu.log | tail -3
fi
if [ "$BT" -gt 0 ]; then
  timeout $BT python3 -u -m experiments.bench_kernels --out_md=$OUT/bench.md --out_json=$OUT/bench.json \
    --time_budget_s=$((BT - 60)) "$@" > $OUT/bench.log 2>&1
  echo "bench rc=$?"; grep -E "^\[(ok|error|skip|breakdown|profile)\]|^\||err\(|registers|spill" $OUT/bench.log | cut -c1-200
fi
if [ "${TRITON_PTXAS:-0}" = 1 ]; then
  PTXAS=$(python3 -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/ptxas'))")
  for f in $(find /tmp/jtdump -name '*.ptx'); do
    echo "== $f $(grep -o "'num_warps': [0-9]*" $(dirname $f)/config | head -1)"
    $PTXAS -arch=sm_90a -v $f -o /dev/null 2>&1 | grep -E "registers|spill" | tr -s ' '
  done > $OUT/ptxas.txt 2>&1
  grep -B2 -E " [1-9][0-9]* bytes spill stores" $OUT/ptxas.txt | grep "==" | cut -c1-160
fi
tar czf $OUT/triton_cache.tgz -C /tmp/triton_cache . 2>/dev/null
ls -la $OUT
