#!/usr/bin/env bash
# Session 28 (2026-12-06): does the probe's launch time (Rates.issue_s) account for the steps at
# few sequences? And what does timing steps as the training loop runs them (`--bench.sync
# window`) change against waiting for the device after every step (`step`)? On one GPU: the
# correctness stage first; the probe's rates for FLAVOR (its blocks timed and their launches, at
# 1 sequence); SlideDP all-resident at SEQS sequences, LAUNCHES launches a timing, interleaved;
# the engine at 256 tokens, where the step is about the host's launches.
# `model_check check --rates OUT/rates.json` then predicts the rows from that start's rates.
#   FLAVOR=qwen3-1.7B BLOCKS=28 LAUNCHES=3 SEQS=1,2 bash launch.sh OUT
set -u
OUT=$1
FLAVOR=${FLAVOR:-qwen3-1.7B} BLOCKS=${BLOCKS:-28} LAUNCHES=${LAUNCHES:-3} SEQS=${SEQS:-1,2}
export PYTHONUNBUFFERED=1
(nvidia-smi; nproc; free -g; lscpu | grep -i "model name") > "$OUT/host.txt" 2>&1
echo "=== correctness $(date +%T)"
if ! timeout 200 python -m pytest -q -rA -s --tb=short tests/test_gpu_options.py -k 'base or resident' \
    > "$OUT/correctness.log" 2>&1; then
  echo "correctness stage failed: nothing measured"; tail -30 "$OUT/correctness.log"; exit 1
fi
tail -2 "$OUT/correctness.log"
echo "=== probe $(date +%T)"
SLIDEDP_RATES_DIR=/tmp/rates timeout 150 python -m recipes.probe train_configs/h200_qwen3_4b_slidedp.toml \
  --model.flavor "$FLAVOR" --slidedp.autopolicy_candidates=keep --training.local_batch_size=1 \
  --out "$OUT/rates.json" > "$OUT/probe.log" 2>&1; echo "rc $?"; tail -4 "$OUT/probe.log"
RUN="--parallelism.mode slidedp --model.kernels liger --model.flavor $FLAVOR --training.max_norm 1.0
  --slidedp.check_host_memory=false --bench.warmup 1 --training.steps 3 --training.nonfinite skip
  --slidedp.embedding_update resident --slidedp.update_order next_use --slidedp.gpu_state_blocks $BLOCKS"
for i in $(seq 1 "$LAUNCHES"); do
  for sync in window step; do
    echo "=== launch $i, sync $sync $(date +%T)"
    timeout 120 python -m recipes.bench.throughput --bench.out="$OUT/rows.jsonl" $RUN \
      --bench.points keep:$SEQS --bench.sync $sync --bench.label resident-$sync \
      --bench.launch=$i >> "$OUT/bench.log" 2>&1
    echo "rc $?"
  done
done
echo "=== floor $(date +%T)"
timeout 100 python -m recipes.bench.throughput --bench.out="$OUT/floor.jsonl" $RUN \
  --training.seq_len 256 --bench.points keep:1 --bench.label floor-256 >> "$OUT/bench.log" 2>&1
echo "rc $?"
cat "$OUT"/rows.jsonl "$OUT"/floor.jsonl | python -c "import sys, json
for r in map(json.loads, sys.stdin): print(r['label'], r['seq'], r['local_batch'], r['step_time_s'], r['tokens_per_s'], r['loss'])"
echo "=== done $(date +%T)"
