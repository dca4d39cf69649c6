#!/bin/bash
# Device-side runner for the correctness checks of issue #15 on one H200 (repo root; no wheels
# needed: jax, flax and pytest are on the machine): the compiled pallas_gpu tests, the jit edge
# cases compiled, then the opt-in past-2^31-elements test. Logs land in $OUT.
#   bash experiments/run_gpu_checks.sh TEST_TIMEOUT LARGE_TIMEOUT
set -u
TT=${1:-240}; LT=${2:-330}
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt
date -u +%FT%TZ > $OUT/date.txt
if [ "$TT" -gt 0 ]; then
  timeout $TT python3 -m pytest tests/test_pallas_gpu.py tests/test_pallas_gpu_intra.py \
    tests/test_index_width.py "tests/test_jit_edges.py" -k "not pallas_tpu and (not test_chunk_jit or kda or gdn2)" \
    -m "slow or not slow" -q -p no:cacheprovider --durations=10 > $OUT/test_gpu.log 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" $OUT/test_gpu.log | tail -3
fi
if [ "$LT" -gt 0 ]; then
  LINEAX_LARGE_TESTS=1 timeout $LT python3 -m pytest tests/test_large_index.py -v -p no:cacheprovider \
    --durations=10 > $OUT/large.log 2>&1
  echo "large rc=$?"; grep -E "PASS|FAIL|passed|failed|error|Error" $OUT/large.log | tail -12
fi
