#!/usr/bin/env bash
# Loaded full-suite runs (issue 27 item 5), continued: as loadci.sh, and a core file left by any
# process gets a backtrace of every thread (gdb) before it is removed.
ulimit -c unlimited
for i in $(seq ${FIRST:-6} ${LAST:-30}); do
  [ -e /tmp/loadci2.stop ] && break
  d=/tmp/lci_$i; rm -rf $d; git clone -q /work/main $d
  (cd $d && git log -1 --format=%h) > /tmp/lci_$i.commit
  taskset -c 0 sh -c 'while :; do :; done' & busy=$!
  start=$(date +%s)
  (cd $d && PATH=/tmp/civenv/bin:$PATH CI=true bash .ci/run) > /tmp/lci_$i.log 2>&1; rc=$?
  kill $busy
  end=$(date +%s)
  term=$(grep -c "terminate called" /tmp/lci_$i.log)
  summ=$(grep -E "passed|failed" /tmp/lci_$i.log | tail -1)
  cores=0
  for c in $(find $d /tmp/pytest-of-root -type f \( -name core -o -name 'core.[0-9]*' \) 2>/dev/null); do
    cores=$((cores + 1))
    exe=$(file "$c" | sed -n "s/.*execfn: '\([^']*\)'.*/\1/p")
    { file "$c"; strings "$c" | grep -m3 "\.py\", line"; gdb -batch -ex "thread apply all bt 8" "${exe:-python3}" "$c" 2>&1 | tail -80; } > /tmp/lci_${i}_core$cores.txt
    rm -f "$c"
  done
  echo "$i $(cat /tmp/lci_$i.commit) rc=$rc $((end-start))s terminate=$term cores=$cores | $summ | load=$(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/loadci.results
  rm -rf $d
done
