#!/usr/bin/env bash
# Session 28 (2026-12-06), call A on one GPU: session 26's ab.sh at the Qwen3-4B headline points
# (correctness stage first, then after/before interleaved, 3 launches a side, the after side
# timed as the old bench times: `--bench.sync step`); then the probe's
# rates for Qwen3-4B with the host seconds to issue each use (Rates.issue_s).
#   bash a.sh OUT
set -u
OUT=$1
FLAVOR=qwen3-4B SEQS=4,1 BLOCKS=36 LAUNCHES=3 TRACE=0 EXTRA="--bench.sync step" \
  CORRECT="tests/test_gpu_options.py -k 'base or resident'" \
  bash docs/results/2026-12-06-h100-session26/ab.sh "$OUT" || exit 1
echo "=== probe $(date +%T)"
SLIDEDP_RATES_DIR=/tmp/rates timeout 110 python -m recipes.probe train_configs/h200_qwen3_4b_slidedp.toml \
  --slidedp.autopolicy_candidates=keep --training.local_batch_size=1 --out "$OUT/rates_4b.json" \
  > "$OUT/probe.log" 2>&1; echo "rc $?"; tail -4 "$OUT/probe.log"
echo "=== done $(date +%T)"
