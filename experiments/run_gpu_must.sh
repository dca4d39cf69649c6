#!/bin/bash
# Device-side runner for issue #17's must line on one H200: the measurements that must all come
# from one day and the final code, in four device calls of under 600 s each (repo root; wheels
# in .whl/ as run_gpu_kernels.sh takes them, pytest-xdist unpacked in .whl/pyxd; carry .whl):
#
#   bash experiments/run_gpu_must.sh tests  # the whole compiled GPU suite, pytest-xdist (-n 10)
#   bash experiments/run_gpu_must.sh ops    # the op table against jla (B4 T4096 H16 D128 and
#                                           # D = 64), linear attention, forward errors
#   bash experiments/run_gpu_must.sh train  # the 350M rows (run_gpu_train.sh paper; its wheels)
#   bash experiments/run_gpu_must.sh sweep  # the T sweep at 65,536 tokens and H 96, against jla
#   bash experiments/run_gpu_must.sh peers  # the "also report" rows: FLA (fla-core 0.6.0)
#                                           # beside ours and jla, and cuDNN softmax attention, at
#                                           # B4 T4096 H16 D128 (PEER_MIXERS picks the mixers)
#
# Every phase writes its raw files into one archive, $OUT/must_PHASE.tgz (the device tool brings
# back only a few files a call), and prints what it found. Back on the CPU machine,
# `python3 -m experiments.must_line` reads them into the must table (docs/BENCHMARKS.md has the
# command). Env: MUST_TAG names the files (default the UTC date), SWEEP_MIXERS (default
# gated_delta_rule,delta_rule,kda), XD (pytest-xdist workers, default "-n 10"), MUST_D64=0 (ops
# without the head-dim-64 table, ~150 s, where that table was already taken that day),
# MUST_VARIANTS (the op table's bench_ab variants, default pallas_gpu,jla; e.g.
# "pallas_gpu,pallas_gpu@walk_overlap=false,jla" times a new default against the old one in the
# same rounds; the must line reads the `pallas_gpu` rows) and MUST_AB_MODES (default
# fwdbwd,fwdbwd_dep; fwdbwd alone where a third variant would not fit the 280 s), SWEEP_BUDGET
# and SWEEP_TIMEOUT (the sweep's time budget and hard limit, default 500 and 540 s; the budget
# skips the points it would overrun, so on an H100 the KDA rows need a call of their own:
# SWEEP_MIXERS=kda; an entry takes 20-35 s with its compile and settle, so even one mixer
# wants SWEEP_BUDGET=270 SWEEP_TIMEOUT=310: at 200 s GDN lost its T 65536 point, 2026-12-07), MUST_MEM_FRACTION (the train phase's XLA memory fraction, default 0.95),
# MUST_TESTS_LIMIT (the suite's limit, default 540 s: 272 s on one H100, > 380 s on another,
# 2026-12-07; an outer `timeout` would kill the phase before it archives the log),
# PEER_MIXERS (peers: default gated_delta_rule,delta_rule,kda,gdn2; FLA autotunes 90-200 s a
# mixer on a cold cache, so a first call takes two mixers; Triton's cache comes back as
# $OUT/triton_cache.tgz, and carried as .whl/triton_cache.tgz it cuts that to seconds; FLA's GDN-2
# backward is patched as run_gpu_kernels.sh FLA_GDN2_PATCH=1 does, timing only),
# MUST_REMAT_AB=1 (the train phase also runs GDN and KDA with model.remat_conv_norm=false and
# GDN-2 with it true, the other side of each default, within the same call), MUST_MEM075=1 (and GDN at JAX's default memory fraction 0.75; its 90 s
# come off the main arms' limit, so with MUST_REMAT_AB=1 too those may be cut: take it apart).
set -u
PHASE=${1:?phase: tests, ops, train, sweep or peers}
TAG=${MUST_TAG:-$(date -u +%F)}
KEEP=/tmp/must_$PHASE; mkdir -p $KEEP
if [ "$PHASE" = train ]; then
  # run_gpu_train.sh installs its own wheels and writes paper.tgz (one bench_parallel file per arm).
  # 95 % of the GPU's memory for XLA: JAX's default 75 % is 105 GiB on an H200 but ~59 GiB on an
  # H100, where the GDN 2:1 step (68 GiB) then fails and GDN-2's is squeezed (2026-12-05i).
  # The whole call stays under 600 s: the main arms get what the optional runs below leave.
  LIMIT=560; [ "${MUST_REMAT_AB:-0}" = 1 ] && LIMIT=300
  [ "${MUST_MEM075:-0}" = 1 ] && LIMIT=$((LIMIT - 90))
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MUST_MEM_FRACTION:-0.95} timeout $LIMIT \
    bash experiments/run_gpu_train.sh paper softmax,gdn,kda,gdn2 6
  if [ "${MUST_REMAT_AB:-0}" = 1 ]; then
    # `model.remat_conv_norm` against each mixer's default (on for GDN and KDA, off for GDN-2:
    # thirty-first stage). An arm takes 65-90 s on an H200 (~50 s of it compiling); 190 s for
    # three cut one off (thirtieth stage), so the three get 250 s, and GDN at JAX's default
    # memory fraction (where it did not fit before the option; measured on both cards by now)
    # runs only when asked.
    XLA_PYTHON_CLIENT_MEM_FRACTION=${MUST_MEM_FRACTION:-0.95} PAPER_SUFFIX=_remat_off timeout 165 \
      bash experiments/run_gpu_train.sh paper gdn,kda 6 --config.model.remat_conv_norm=false
    XLA_PYTHON_CLIENT_MEM_FRACTION=${MUST_MEM_FRACTION:-0.95} PAPER_SUFFIX=_remat_on timeout 85 \
      bash experiments/run_gpu_train.sh paper gdn2 6 --config.model.remat_conv_norm=true
  fi
  if [ "${MUST_MEM075:-0}" = 1 ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 PAPER_SUFFIX=_mem075 timeout 90 \
      bash experiments/run_gpu_train.sh paper gdn 6
  fi
  mv $OUT/paper.tgz $OUT/must_train.tgz 2>/dev/null
  exit 0
fi
# jla, jax-triton, FLA and einops: what the twentieth stage's compiled suite and tables ran with.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/.whl/pyxd:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
[ -f .whl/triton_cache.tgz ] && tar xzf .whl/triton_cache.tgz -C $TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > $KEEP/gpu.txt
git log -1 --format=%H > $KEEP/rev.txt 2>/dev/null   # (the device copy's .git: may be stale)
bash experiments/sources_sha.sh > $KEEP/sources_sha.txt   # the code that ran
date -u +%FT%TZ > $KEEP/date.txt
# Files are named by the GPU that made them (h200_TAG, h100_TAG): a call may land on either.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr H h)
GPU_TAG=${GPU:-gpu}_$TAG
case $PHASE in
tests)
  # Every file with compiled GPU tests (docs/KERNELS_GPU.md "Testing"); the GPU machine's 16
  # cores compile in parallel, which is where the suite's time goes. `slow` cases too: the CPU
  # run leaves them to a faster case in the interpreter, compiled they cost seconds.
  FILES="tests/test_triton_gpu.py tests/test_pallas_gpu.py tests/test_pallas_gpu_intra.py
    tests/test_chunk_grads.py tests/test_chunk_walk.py tests/test_walk_pieces.py
    tests/test_state_pass_pieces.py tests/test_gpu_tuning_plumbing.py
    tests/test_channel_pair_kernel.py tests/test_attention.py tests/test_large_index.py
    tests/test_triton_ffi_call.py tests/test_triton_path.py tests/test_bench_ops.py
    tests/test_state_pass_out_dtype.py tests/test_state_pass_o_rows.py
    tests/test_state_pass_products.py"
  # MUST_TESTS_LIMIT cuts the suite, not the call, so a short budget still brings back its log.
  timeout ${MUST_TESTS_LIMIT:-540} env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest $FILES ${XD:--n 10} -v \
    -m "slow or not slow" -p no:cacheprovider -rs --durations=15 > $KEEP/test_gpu_${GPU_TAG}_compiled_suite.log 2>&1
  echo "pytest rc=$?"; grep -E "FAILED|ERROR" $KEEP/test_gpu_*.log | head -20
  tail -1 $KEEP/test_gpu_*.log
  ;;
ops)
  AB="python3 -u -m experiments.bench_ab --timing=queued --baseline=jla"
  timeout 280 $AB --mixers=gated_delta_rule,delta_rule,kda,gdn2 --modes=${MUST_AB_MODES:-fwdbwd,fwdbwd_dep} \
    --variants=${MUST_VARIANTS:-pallas_gpu,jla} --rounds=5 --shape=4,4096,16,128 \
    --out_json=$KEEP/bench_ab_${GPU_TAG}_must_table.json --out_md=$KEEP/bench_ab_${GPU_TAG}_must_table.md \
    > $KEEP/ab_table.log 2>&1
  echo "table rc=$?"
  timeout 50 python3 -u -m experiments.bench_ab --mixers=linear_attention --modes=fwdbwd \
    --timing=queued --baseline=pallas_gpu --variants=pallas_gpu --rounds=5 --shape=4,4096,16,128 \
    --out_json=$KEEP/bench_ab_${GPU_TAG}_must_linear_attention.json \
    --out_md=$KEEP/bench_ab_${GPU_TAG}_must_linear_attention.md > $KEEP/ab_la.log 2>&1
  echo "linear attention rc=$?"
  timeout 100 python3 -u -m experiments.bench_kernels --shapes=4,4096,16,128 --modes=fwd \
    --impls=pallas_gpu --mixers=gated_delta_rule,delta_rule,kda,gdn2,linear_attention \
    --out_json=$KEEP/bench_kernels_${GPU_TAG}_must_fwd_err.json \
    --out_md=$KEEP/bench_kernels_${GPU_TAG}_must_fwd_err.md > $KEEP/fwd_err.log 2>&1
  echo "fwd_err rc=$?"
  [ "${MUST_D64:-1}" = 0 ] || timeout 150 $AB --mixers=gated_delta_rule,delta_rule,kda,gdn2 --modes=fwdbwd \
    --variants=pallas_gpu,jla --rounds=3 --shape=4,4096,32,64 --out_json=$KEEP/bench_ab_${GPU_TAG}_must_d64.json \
    --out_md=$KEEP/bench_ab_${GPU_TAG}_must_d64.md > $KEEP/ab_d64.log 2>&1
  echo "d64 rc=$? (MUST_D64=${MUST_D64:-1})"
  grep -hE "^\*\*|^\| (pallas|jla)" $KEEP/*.md | head -40
  ;;
peers)
  # fla-core 0.6.0's GDN-2 backward does not compile on triton 3.6 (a bf16 x float32 tl.dot);
  # the cast run_gpu_kernels.sh FLA_GDN2_PATCH=1 applies, timing only.
  f=/tmp/site/fla/ops/gdn2/chunk_bwd.py
  [ -f $f ] && sed -i 's/tl.dot(b_dv, tl.trans(b_v \* b_wg), b_dA)/tl.dot(b_dv, tl.trans((b_v * b_wg).to(b_dv.dtype)), b_dA)/' $f
  timeout 470 python3 -u -m experiments.bench_ab --timing=queued --baseline=jla \
    --mixers=${PEER_MIXERS:-gated_delta_rule,delta_rule,kda,gdn2} --modes=fwdbwd \
    --variants=pallas_gpu,jla,fla --rounds=3 --shape=4,4096,16,128 \
    --out_json=$KEEP/bench_ab_${GPU_TAG}_must_peers.json --out_md=$KEEP/bench_ab_${GPU_TAG}_must_peers.md \
    > $KEEP/ab_peers.log 2>&1
  echo "peers rc=$?"
  timeout 60 python3 -u -m experiments.bench_kernels --impls=cudnn --mixers=gated_delta_rule \
    --modes=fwdbwd --shapes=4,4096,16,128 --out_json=$KEEP/bench_kernels_${GPU_TAG}_must_cudnn.json \
    --out_md=$KEEP/bench_kernels_${GPU_TAG}_must_cudnn.md > $KEEP/cudnn.log 2>&1
  echo "cudnn rc=$?"
  grep -hE "^\*\*|^\| (pallas|jla|fla)" $KEEP/bench_ab_*_must_peers.md | head -20
  ;;
sweep)
  timeout ${SWEEP_TIMEOUT:-540} python3 -u -m experiments.bench_kernels --impls=pallas_gpu,jla \
    --mixers=${SWEEP_MIXERS:-gated_delta_rule,delta_rule,kda} --modes=fwdbwd --shapes=1,8192,96,128 \
    --sweep_tokens=65536 --err_tol=1 --time_budget_s=${SWEEP_BUDGET:-500} \
    --out_json=$KEEP/bench_kernels_${GPU_TAG}_must_sweep.json \
    --out_md=$KEEP/bench_kernels_${GPU_TAG}_must_sweep.md > $KEEP/sweep.log 2>&1
  echo "sweep rc=$?"; grep -A12 "T sweep at" $KEEP/sweep.log
  ;;
*)
  echo "unknown phase $PHASE: tests, ops, train or sweep"; exit 2
  ;;
esac
tar czf $OUT/must_$PHASE.tgz -C $KEEP .
tar czf $OUT/triton_cache.tgz -C $TRITON_CACHE_DIR . 2>/dev/null
ls -la $OUT
