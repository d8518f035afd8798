#!/usr/bin/env bash
# Session 27 (2026-12-06) on one GPU: every-unit-resident GPU updates issued from the compute
# thread (after) against queued on the update thread (before = `git archive 4579b2c` in .prev/),
# launches interleaved after a correctness stage, then one traced launch a side.
#   FLAVOR=qwen3-1.7B SEQS=2,1 BLOCKS=28 LAUNCHES=3 bash ab.sh OUT
set -u
OUT=$1
FLAVOR=${FLAVOR:-qwen3-1.7B} SEQS=${SEQS:-2,1} BLOCKS=${BLOCKS:-28} LAUNCHES=${LAUNCHES:-3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$(nproc)
(nvidia-smi; nproc; free -g; python -c "import torch; print(torch.__version__)") > "$OUT/host.txt" 2>&1
log() { echo "=== $* $(date +%T)" | tee -a "$OUT/launches.log"; }
log correctness
if ! timeout 200 python -m pytest -q -rA -s --durations=0 --tb=short tests/test_gpu_options.py \
    -k "base or resident" > "$OUT/correctness.log" 2>&1; then
  echo "correctness stage failed: nothing measured"; tail -30 "$OUT/correctness.log"; exit 1
fi
tail -2 "$OUT/correctness.log"
FLAGS="--parallelism.mode slidedp --model.kernels liger --model.flavor $FLAVOR --training.max_norm 1.0
  --slidedp.check_host_memory=false --bench.warmup 1 --training.steps 3 --training.nonfinite skip
  --slidedp.embedding_update resident --slidedp.update_order next_use --slidedp.gpu_state_blocks $BLOCKS
  --bench.points keep:$SEQS"
side() {  # side DIR LABEL EXTRA...
  local dir=$1 label=$2; shift 2
  (cd "$dir" && timeout 110 python -m recipes.bench.throughput --bench.out="$OUT/$label.jsonl" \
    $FLAGS --bench.label "$label" "$@") >> "$OUT/launches.log" 2>&1
  echo "rc $?" | tee -a "$OUT/launches.log"
}
for i in $(seq 1 "$LAUNCHES"); do
  log "after $i"; side . after --bench.launch=$i
  log "before $i"; PYTHONPATH=.:${PYTHONPATH:-} side .prev before --bench.launch=$i
done
log traced
side . traced-after --bench.trace_dir "$OUT/trace_after"
PYTHONPATH=.:${PYTHONPATH:-} side .prev traced-before --bench.trace_dir "$OUT/trace_before"
rm -rf "$OUT/trace_after" "$OUT/trace_before"  # the rows carry the timeline's breakdown
log done
python -m recipes.bench.headline "$OUT"/after.jsonl "$OUT"/before.jsonl 2>&1 | tail -8
