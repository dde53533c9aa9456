#!/bin/bash
# A whole device session of issue 15's experiment as ONE process that outlives its device call:
# `world_call.sh` (the base's build and measurement, the runs, their scoring, `--finish`) started
# detached (setsid: the device machine kills what a call leaves running, except a new process
# session) in its own copy of the tree. Each call, the first included, then waits until CALL_S
# seconds after it began or the pipeline's end, and brings back its files. Against chained
# `world_call.sh` calls, the runs never stop and restart (~40 s a call at 77M) and go on
# training between calls; the machine must still be called again within its ~30 s of idle
# grace, or it goes back with everything.
#
# usage (device machine, repo root; env as for world_call.sh: D, BASE, BUILD_GPUS, ROLLOUTS):
#   OUT=$OUT D=.gpu/s22 BASE=world-nocount-77m BUILD_GPUS=0,1,2,3 \
#       bash benchmarks/world_detached.sh CALL_S TOTAL_S [world_experiment.py args]
# CALL_S: when this call returns (585 in a 600 s call); TOTAL_S: seconds after the FIRST call
# began by which the runs are scored (training stops SCORE_S, default 90, before it). Later calls
# pass the same arguments (only the first call's start them). What comes back under $OUT: the
# pipeline's own files (progress.tgz every 30 s, at the end results.json and world_experiment.*),
# pipeline.log, and `rc` once it has ended; they are copied every BRING_S (30) s while the call
# waits, so a call ended early by the device's limit returns the last copy. Should the machine
# end the pipeline when a call returns anyway, the next calls go on as chained world_call.sh
# calls (their output as world_call.sh's).
# SESSION_T0=EPOCH (env, optional): when the caller made (or is about to make) its session's
# first call. A call later than LATE_S (300) s after it that finds no pipeline on its machine
# has landed on a fresh one (the last went back idle, with the base and the runs): it prints
# "machine lost" and exits 3 at once instead of starting again, since a restart could not
# finish in the device time the session has left and a ~440 s rebuild of the base would
# spend it. A new SESSION_T0 starts over. (300 s: a second call comes CALL_S after the first,
# while the first may wait a few minutes on its caller and a cold machine's start.)
set -u
T0=$(date +%s)
CALL=${1:?CALL_S}; TOTAL=${2:?TOTAL_S}; shift 2
P=${DETACHED:-/tmp/world_detached}  # the pipeline's tree, its OUT and its state, per machine
SCORE=${SCORE_S:-90}
export WORLD_CALL=${WORLD_CALL:-bash benchmarks/world_call.sh}  # (another command, for tests)
if [ ! -f $P/started ] && [ -n "${SESSION_T0:-}" ] && [ $T0 -gt $(( SESSION_T0 + ${LATE_S:-300} )) ]; then
  echo "machine lost: no pipeline on this machine $(( T0 - SESSION_T0 )) s after the session's" \
       "first call; not starting it again (a new SESSION_T0 starts over)"
  exit 3
fi
if [ ! -f $P/started ]; then
  mkdir -p $P/repo $P/out
  # its own copy: a later call's copy of the working tree may replace files under this one
  tar cf - --exclude=./.git --exclude=./benchmarks/results . | tar xf - -C $P/repo || exit 1
  echo $T0 > $P/started
  # nothing of it may hold the call's output open, or the call would wait for it
  cd $P/repo
  OUT=$P/out setsid bash -c '$WORLD_CALL "$@"; echo $? > "$0"' \
      $P/rc $(( TOTAL - SCORE )) --finish "$@" > $P/pipeline.log 2>&1 < /dev/null &
  echo $! > $P/pid
  cd - > /dev/null
  echo "$(date -u +%T) pipeline started (scored by ${TOTAL} s from now)"
elif [ ! -f $P/rc ] && ! ps -o stat= -p $(cat $P/pid) | grep -qv Z; then  # (a zombie is gone)
  # the machine ended it after all (it does so where commands run as an ordinary user): this and
  # later calls go on as chained world_call.sh calls, from its runs' checkpoints; the one whose
  # end passes the scoring deadline scores them where they are
  LEFT=$(( $(cat $P/started) + TOTAL - $(date +%s) ))
  echo "the detached pipeline is gone; going on as a chained call ($LEFT s to the deadline)"
  cd $P/repo
  if [ $LEFT -le $(( CALL + 30 )) ]; then END="$(( LEFT - SCORE )) --finish"; else END=$CALL; fi
  $WORLD_CALL $END "$@"
  exit
fi
bring() {  # also while waiting: a call its device limit ends early still returns the last copy
  cp $P/pipeline.log $OUT/ 2> /dev/null
  find $P/out -maxdepth 1 -type f ! -name '*.tmp' -exec cp {} $OUT/ \;
  [ -f $P/rc ] && cp $P/rc $OUT/
}
LAST=$T0
while [ ! -f $P/rc ] && [ $(( $(date +%s) - T0 )) -lt $CALL ]; do
  sleep 1
  if [ $(( $(date +%s) - LAST )) -ge ${BRING_S:-30} ]; then bring; LAST=$(date +%s); fi
done
bring
tail -n 25 $P/pipeline.log 2> /dev/null
if [ -f $P/rc ]; then echo "pipeline ended: exit $(cat $P/rc)"
else echo "pipeline running, $(( $(date +%s) - $(cat $P/started) )) s in: call again within 30 s"; fi
