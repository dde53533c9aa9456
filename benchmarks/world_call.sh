#!/bin/bash
# One device call of issue 15's experiment (world_experiment.py on a world base), made to be
# chained: the runs live in $RUNS (/tmp/wx_$BASE on the device machine), so the same command on
# the still-warm machine (next call within ~30 s) continues them from their checkpoints; the call
# whose runs reach train.steps scores them (held-out, selection, cross-play) and writes
# results.json. Only small files come back under $OUT (never checkpoints): progress.tgz
# (every 30 s: call log, GPU/CPU load, each run's job record and metrics.jsonl, gate probe) and,
# when finished, results.json (+ world_experiment.json/.png with both arms population and single).
#
# usage (device machine, repo root, whose src/ and benchmarks/ run; D holds models/$BASE_bf16.tgz.part*
# unless MODEL_DIR/$BASE is a model already (BASE: world-short unless set); with neither, the
# call first rebuilds BASE from its seed (`lorapop pretrain-tiny --size $BASE`, its log
# build.log in progress.tgz; a build that does not fit the call stops in time, and the next
# call goes on with it), returns it as $OUT/models/${BASE}_bf16.tgz.part* (carried back as
# $D/models, a fresh machine unpacks them) and measures it (`tiny_world.py`:
# tiny_world_$BASE.json in progress.tgz), which END_S counts. A call returns at most 8 files,
# so the build's logs travel inside progress.tgz and its three parts always come back;
# D optionally holds sets/ with heldout/select/seed_tasks*.jsonl and level_table.txt of the
# base's level table):
#   OUT=$OUT D=.gpu/world bash benchmarks/world_call.sh END_S [world_experiment.py args]
#   e.g. ... world_call.sh 470 --arms single --seeds 0 1 2 --parallel 3          (the gate)
#        ... world_call.sh 470 train.lr=3e-3 --arms single --seeds 0 --parallel 1  (overrides first)
#        ... world_call.sh 470 --gpus 8 --parallel 21                            (the experiment)
#        ... world_call.sh 330 --gpus 4 --parallel 21 --finish   (last call of a chain that cannot
#            reach train.steps: every run is scored at the step it reached)
#   two settings at once, one per GPU (each chain its own RUNS, OUT and CUDA_VISIBLE_DEVICES):
#        CUDA_VISIBLE_DEVICES=1 RUNS=/tmp/wx_r32 OUT=$OUT/r32 D=... world_call.sh 580 lora.rank=32 ... &
# BUILD_GPUS=0,1 (env): a build of the base runs data parallel over those GPUs (torchrun).
# PROPOSALS=N (env, default 40): the measurement's proposals per type and level.
# ROLLOUTS=N (env): progress.tgz also holds each run's last N steps' rollouts (what its proposals
# and answers were; progress.tgz must stay under the 16 MiB a returned file may have).
# END_S: seconds after the call began at which training checkpoints and stops (leave ~100 s of a
# 600 s call for the scoring when the runs can finish in this call).
set -u
T0=$(date +%s)
D=${D:?set D to the carried directory}
END=${1:?END_S}; shift
# Two chains may share a machine (other RUNS, OUT and CUDA_VISIBLE_DEVICES, e.g. two settings of
# one world side by side): the install and the base's unpack or build are done once, under a lock.
exec 9> /tmp/world_call.lock
flock 9
# the wheels once per machine: a call that lands on a fresh machine (the last one went back
# idle) installs them again by itself. SKIP_PIP=1: a python that has the packages already (CPU)
STAMP=/tmp/site/.wheels_$(cat .whl/*.whl 2> /dev/null | md5sum | cut -c1-12)
if [ -z "${SKIP_PIP:-}" ] && [ ! -f $STAMP ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && touch $STAMP || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src
M=${MODEL_DIR:-/tmp/m}
TW=''  # the base's measurement, when this call built it
B=${BASE:-world-short}
W=${RUNS:-/tmp/wx_$B}  # per base: a second base on the same machine starts its own runs
mkdir -p $M $OUT $W
built() { [ -f $M/$B/config.json ]; }
if ! built; then
  if ls $D/models/${B}_bf16.tgz.part* > /dev/null 2>&1; then
    cat $D/models/${B}_bf16.tgz.part* | tar xzf - -C $M || exit 1
  else  # no parts: rebuild the base from its seed (BASE a pretrain-tiny size; ~380 s on an H100);
    # a build the call cannot finish stops in time and the next call goes on with it (each
    # sitting remakes the corpus and batches first: ~100 s, so one with less left is not begun)
    LEFT=$(( END - ($(date +%s) - T0) - 30 ))
    if [ $LEFT -lt 180 ]; then
      echo "$(date -u +%T) $B not built yet; $LEFT s left: the next call goes on" | tee -a $W/call.log >&2
    else
      echo "$(date -u +%T) building $B${BUILD_GPUS:+ on GPUs $BUILD_GPUS}" >&2
      T1=$(date +%s)
      build() { python3 "$@" -m lorapop pretrain-tiny --size $B --out $M/$B --device auto \
          --workers $(( $(nproc) - 1 )) --stop-after $(( LEFT - $(date +%s) + T1 )) >> $W/build.log 2>&1; }
      # BUILD_GPUS=0,1: data parallel over those GPUs (torchrun); should that fail, one GPU goes
      # on from where it stopped
      if [ -n "${BUILD_GPUS:-}" ]; then
        CUDA_VISIBLE_DEVICES=$BUILD_GPUS build -m torch.distributed.run --standalone \
            --nproc-per-node $(( $(tr -cd , <<< $BUILD_GPUS | wc -c) + 1 )) \
          || { echo "data-parallel build failed; going on on one GPU" | tee -a $W/build.log >&2; build; }
      else build; fi || { tail -5 $W/build.log; exit 1; }
      tail -1 $W/build.log >&2
    fi
    # as bf16 15 MiB parts (what the runs load on CUDA anyway): carried as $D/models, a later
    # call on a fresh machine unpacks them instead of building again. A base over 120 MiB in
    # fp32 (60 MiB in bf16, e.g. 77M parameters) can neither come back (8 files a call) nor be
    # carried (64 MiB): it stays on this machine, whose later calls gate it
    if built && [ $(stat -c %s $M/$B/model.safetensors) -gt $((120 << 20)) ]; then
      echo "$B: too large to travel, kept on this machine only" >&2
    elif built; then python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path
from world_recipes import pack_model; print(*pack_model(Path('$M/$B'), Path('$OUT/models')))" >&2
    fi
    # the new base's regime (~15-35 s), measured beside the runs' first steps (half the cores)
    built && { python3 benchmarks/tiny_world.py --model $M/$B --device auto \
        --workers $(( $(nproc) / 2 )) --proposals ${PROPOSALS:-40} --out $W/tiny_world_$B.json \
        > $W/tiny_world.log 2>&1 || tail -3 $W/tiny_world.log; } &
    TW=$!
  fi
fi
flock -u 9
rm -f $W/stop
[ -d $D/sets ] && cp -n $D/sets/* $W/
if [ -d $W/runs ]; then echo "continuing: $(ls $W/runs | wc -l) runs on this machine" >> $W/call.log
else echo "$(date -u +%T) no runs on this machine yet: they start from step 0" | tee -a $W/call.log >&2; fi
S="sampling.teacher_max_new_tokens=256 sampling.student_max_new_tokens=192 run.keep_last=1"
DL=$(( END - ($(date +%s) - T0) ))
echo "$(date -u +%T) setup $(( $(date +%s) - T0 )) s, deadline $DL s, args $*" >> $W/call.log
pack() {  # small files only: no checkpoints or adapters; rollouts of the last $ROLLOUTS steps
  ( cd $W && ls *.log tiny_world_*.json gate_probe.json gate_probe.png jobs/*.out.json \
      runs/*/metrics.jsonl 2>/dev/null
    [ "${ROLLOUTS:-0}" -gt 0 ] && for r in runs/*/rollouts; do
      ls -v $r/step_*.jsonl.gz 2>/dev/null | tail -n $ROLLOUTS; done ) \
    | tar czf $OUT/progress.tgz.tmp -C $W -T - 2>/dev/null && mv $OUT/progress.tgz.tmp $OUT/progress.tgz; }
( while [ ! -f $W/stop ]; do
    { date -u +%T; uptime; ! command -v nvidia-smi > /dev/null || nvidia-smi \
        --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>&1; } >> $W/load.log
    pack; sleep 30
  done ) &
TP=$!
if [ $DL -ge 60 ] && built; then
  python3 benchmarks/world_experiment.py $S --model $M/$B --out $W --deadline $DL \
      --per-level 20 --workers 4 "$@" > $W/experiment.log 2>&1
  echo "$(date -u +%T) exit $? after $(( $(date +%s) - T0 )) s" >> $W/call.log
else  # a build that used the call: the runs start in the next one
  echo "$(date -u +%T) no runs: $DL s left after the set-up$(built || echo ', the base not built yet')" \
    | tee -a $W/call.log $W/experiment.log
fi
touch $W/stop; kill $TP 2>/dev/null; wait $TP 2>/dev/null   # (not the loop's 30 s sleep)
[ -n "$TW" ] && wait $TW
python3 benchmarks/world_experiment.py --out $W --gate-probe > /dev/null 2>> $W/call.log
pack
for f in results.json world_experiment.json world_experiment.png; do
  [ -f $W/$f ] && cp $W/$f $OUT/
done
tail -25 $W/experiment.log; cat $W/call.log; tail -4 $W/load.log
