#!/bin/bash
# run_watched.sh LOG LIMIT_S python-args... : run python3 -X faulthandler with a time limit; when the bench has printed
# its result line but has not exited 20 s later, SIGABRT it (faulthandler prints every thread's stack) and kill it.
log=$1; limit=$2; shift 2
start=$(date +%s)
python3 -X faulthandler "$@" > "$log" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  if grep -q '"errors"' "$log" 2>/dev/null; then
    for i in $(seq 20); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    if kill -0 $pid 2>/dev/null; then echo "WATCH: alive 20 s after its result, SIGABRT" >> "$log"; kill -ABRT $pid; sleep 5; kill -9 $pid 2>/dev/null; fi
    break
  fi
  if [ $(( $(date +%s) - start )) -ge $limit ]; then echo "WATCH: limit $limit s, SIGABRT" >> "$log"; kill -ABRT $pid; sleep 5; kill -9 $pid 2>/dev/null; break; fi
  sleep 2
done
wait $pid; echo "WATCH: exit $? after $(( $(date +%s) - start )) s" >> "$log"
