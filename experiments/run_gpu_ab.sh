#!/bin/bash
# A/B of two code versions in one device call, on one warm GPU: a command run from a copy of
# an older commit's library beside the work tree, then from the work tree, alternating. Timing
# both in one call is what makes a code change's gain comparable (the same card, clocks and
# drivers); bench_ab's variants cover tunings of one version only.
#
#   bash experiments/run_gpu_ab.sh prepare REV     # CPU side: REV's lineax_attn, pallas_kernels,
#                                                  # experiments and configs into ab_base/
#                                                  # (git-ignored; carry it: [".whl", "ab_base"])
#   bash experiments/run_gpu_ab.sh run ROUNDS 'CMD'   # device side: CMD ROUNDS times per side,
#                                                     # base first; $SIDE (base / new), $ROUND
#                                                     # and $KEEP are set for CMD's file names
# e.g.
#   bash experiments/run_gpu_ab.sh run 1 'python3 -u -m experiments.bench_ab --mixers=kda,gdn2 \
#     --modes=fwdbwd --variants=pallas_gpu,jla --baseline=jla --timing=queued --rounds=3 \
#     --out_md=$KEEP/ab_${SIDE}_$ROUND.md --out_json=$KEEP/ab_${SIDE}_$ROUND.json'
#
# Wheels as run_gpu_must.sh takes them (.whl/*.whl); everything CMD writes under $KEEP, and
# its output, come back in one archive, $OUT/ab.tgz (the device tool brings back few files).
# AB_LIMIT (default 570) is the seconds the whole run may take; a round that would start
# later than AB_LIMIT - 30 is skipped.
set -u
MODE=${1:?mode: prepare or run}
if [ "$MODE" = prepare ]; then
  REV=${2:?prepare REV}
  rm -rf ab_base && mkdir ab_base
  git archive "$REV" lineax_attn pallas_kernels experiments configs | tar x -C ab_base
  git rev-parse "$REV" > ab_base/REV
  echo "ab_base/ holds $(cat ab_base/REV)'s library"
  exit 0
fi
ROUNDS=${2:?run ROUNDS CMD}; CMD=${3:?run ROUNDS CMD}
[ -d ab_base ] || { echo "no ab_base/: run 'prepare REV' on the CPU side and carry it"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TRITON_CACHE_DIR=/tmp/triton_cache
export KEEP=/tmp/keep_ab; mkdir -p $KEEP $TRITON_CACHE_DIR
ROOT=$PWD
ln -sfn $ROOT/.whl ab_base/.whl   # run_gpu_train.sh reads its wheels from the tree it runs in
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > $KEEP/gpu.txt
cp ab_base/REV $KEEP/base_rev.txt 2>/dev/null; date -u +%FT%TZ > $KEEP/date.txt
bash experiments/sources_sha.sh > $KEEP/new_sources_sha.txt   # the new side's code
(cd ab_base && bash $ROOT/experiments/sources_sha.sh) > $KEEP/base_sources_sha.txt
t0=$(date +%s)
for ROUND in $(seq 1 $ROUNDS); do
  for SIDE in base new; do
    [ $(( $(date +%s) - t0 )) -gt $(( ${AB_LIMIT:-570} - 30 )) ] && { echo "skipped $SIDE $ROUND (time)"; continue; }
    dir=$ROOT; [ $SIDE = base ] && dir=$ROOT/ab_base
    left=$(( ${AB_LIMIT:-570} - ($(date +%s) - t0) ))
    (cd $dir && export SIDE ROUND PYTHONPATH=/tmp/site:$dir && timeout $left bash -c "$CMD") \
      > $KEEP/run_${SIDE}_$ROUND.log 2>&1
    echo "$SIDE $ROUND rc=$? t=$(( $(date +%s) - t0 ))"; tail -n 3 $KEEP/run_${SIDE}_$ROUND.log
    tar czf $OUT/ab.tgz -C $KEEP .
  done
done
