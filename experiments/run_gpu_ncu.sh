#!/bin/bash
# Device-side: what one walk kernel's warps wait on, instruction by instruction (Nsight Compute).
#
# The walks step in ~2 µs where their dependent products alone would take ~0.3 µs, and removing
# two of the reverse step's five waits saved 5-8 %, not the ~40 % that "a wgmma's latency sets
# the step" predicted (docs/KERNELS_GPU.md). ncu's warp-state sampling says where the warps
# stall, per SASS instruction, without touching the kernel. Usage (repo root, GPU machine, wheels
# in .whl/ as run_gpu_kernels.sh takes them; carry .whl):
#
#   bash experiments/run_gpu_ncu.sh walk reverse     # one report per bench_walks kernel named
#
# Each kernel is `bench_walks --kernels=KERNEL --pieces=1` at NCU_SHAPE (default B4 T16384 H16
# D128, the shape its step times were taken at), `--overlap=${NCU_OVERLAP:-false}`, gated
# unless NCU_GATED=0, each under NCU_TIMEOUT seconds (default 240). ncu profiles the third
# Mosaic GPU launch (the first two are warm-up) with `--set full` and leaves the clocks alone
# (METHOD.md). Everything lands in one archive, $OUT/ncu.tgz (the device tool brings back only
# a few files): per kernel its details page (text), its source page (SASS with per-instruction
# samples, CSV) and its raw metrics (CSV); the reports themselves beside it where each is under
# 15 MB. `python3 -m experiments.ncu_stalls` summarises a source page on any machine.
set -u
[ $# -gt 0 ] || { echo "usage: run_gpu_ncu.sh KERNEL [KERNEL ...] (bench_walks kernels)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/jax_linear_attention-*.whl .whl/einops-*.whl > /tmp/ncu_pip.log 2>&1 || { cat /tmp/ncu_pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
KEEP=/tmp/ncu; rm -rf $KEEP; mkdir -p $KEEP
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $KEEP/gpu.txt
ncu --version | tail -1 >> $KEEP/gpu.txt
git log -1 --format=%H > $KEEP/rev.txt 2>/dev/null   # (the device copy's .git: may be stale)
bash experiments/sources_sha.sh > $KEEP/sources_sha.txt   # the code that ran
GATED=$([ "${NCU_GATED:-1}" = 0 ] && echo --nogated || echo --gated)
for K in "$@"; do
  NAME=${K}_$([ "$GATED" = --gated ] && echo gated || echo ungated)_overlap-${NCU_OVERLAP:-false}
  timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 \
    --set full --import-source yes -f -o $KEEP/$NAME \
    python3 -u -m experiments.bench_walks --shape=${NCU_SHAPE:-4,16384,16,128} --pieces=1 \
    --kernels=$K $GATED --overlap=${NCU_OVERLAP:-false} --iters=1 --rounds=3 > $KEEP/$NAME.log 2>&1
  echo "$NAME: ncu rc=$?"; grep -E "^==PROF==|^==ERROR==|^==WARNING==" $KEEP/$NAME.log | head -5
  [ -f $KEEP/$NAME.ncu-rep ] || continue   # (every walk is "body_mosaic_gpu_kernel")
  ncu --import $KEEP/$NAME.ncu-rep --page details --print-details all > $KEEP/${NAME}_details.txt 2>&1
  ncu --import $KEEP/$NAME.ncu-rep --page source --csv --print-source sass > $KEEP/${NAME}_sass.csv 2>&1
  ncu --import $KEEP/$NAME.ncu-rep --page raw --csv > $KEEP/${NAME}_raw.csv 2>&1
  grep -E "Duration|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Occ" \
    $KEEP/${NAME}_details.txt | head -12
  python3 -m experiments.ncu_stalls --csv=$KEEP/${NAME}_sass.csv --top=25 > $KEEP/${NAME}_stalls.txt 2>&1
  head -60 $KEEP/${NAME}_stalls.txt
done
# The reports travel only where they fit the device tool's 16 MiB a file; the pages always do.
tar czf $OUT/ncu.tgz --exclude='*.ncu-rep' -C /tmp ncu
for R in $KEEP/*.ncu-rep; do
  [ -f "$R" ] && [ $(stat -c %s "$R") -lt 15000000 ] && cp "$R" $OUT/
done
