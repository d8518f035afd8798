#!/usr/bin/env bash
# Session 26 (2026-12-06) on one GPU: the engine cut and the route classes (issue 26) before and
# after, launches interleaved (after, before, after, ...), after a correctness stage; then, with
# TRACE=1, one traced launch of SlideDP and of the reference (the rows carry the timeline's
# breakdown). Before = `git archive 2ccb66f` in .old/, whose bench takes the old flag names.
#   FLAVOR=qwen3-4B SEQS=4,1 BLOCKS=36 REF_SEQS=4 LAUNCHES=3 TRACE=1 \
#   CORRECT="tests/test_gpu_options.py -k 'base or resident'" bash ab.sh OUT
# EXTRA: more flags for the after side (session 28: `--bench.sync step`, the old bench's timing).
set -u
OUT=$1
FLAVOR=${FLAVOR:-qwen3-4B} SEQS=${SEQS:-4,1} BLOCKS=${BLOCKS:-36} REF_SEQS=${REF_SEQS:-4}
LAUNCHES=${LAUNCHES:-3} TRACE=${TRACE:-1}
CORRECT=${CORRECT:-"tests/test_gpu_options.py -k 'base or resident'"}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$(nproc)
(nvidia-smi; nproc; free -g; python -c "import torch; print(torch.__version__)") > "$OUT/host.txt" 2>&1
log() { echo "=== $* $(date +%T)" | tee -a "$OUT/launches.log"; }
log correctness: $CORRECT
if ! eval timeout 340 python -m pytest -q -rA -s --durations=0 --tb=short $CORRECT \
    > "$OUT/correctness.log" 2>&1; then
  echo "correctness stage failed: nothing measured"; tail -30 "$OUT/correctness.log"; exit 1
fi
tail -3 "$OUT/correctness.log"
NEW="--parallelism.mode slidedp --model.kernels liger --model.flavor $FLAVOR --training.max_norm 1.0
  --slidedp.check_host_memory=false --bench.warmup 1 --training.steps 3 --training.nonfinite skip
  --slidedp.embedding_update resident --slidedp.update_order next_use --slidedp.gpu_state_blocks $BLOCKS
  --bench.points keep:$SEQS ${EXTRA:-}"
OLD="--mode slidedp --kernels liger --flavor $FLAVOR --max-norm 1.0 --no-memory-check --warmup 1
  --steps 3 --nonfinite skip --embedding-update resident --update-order next_use
  --gpu-state-blocks $BLOCKS --points keep:$SEQS"
for i in $(seq 1 "$LAUNCHES"); do
  log "after $i"
  timeout 110 python -m recipes.bench.throughput --bench.out="$OUT/after.jsonl" $NEW \
    --bench.label after --bench.launch=$i >> "$OUT/launches.log" 2>&1; echo "rc $?" | tee -a "$OUT/launches.log"
  log "before $i"
  (cd .old && PYTHONPATH=.:${PYTHONPATH:-} timeout 110 python -m recipes.bench.throughput \
    --out "$OUT/before.jsonl" $OLD --label before --launch $i) >> "$OUT/launches.log" 2>&1
  echo "rc $?" | tee -a "$OUT/launches.log"
done
if [ "$TRACE" = 1 ]; then
  log traced
  timeout 110 python -m recipes.bench.throughput --bench.out="$OUT/traced.jsonl" $NEW \
    --bench.label traced --bench.trace_dir "$OUT/trace" >> "$OUT/launches.log" 2>&1
  echo "rc $?" | tee -a "$OUT/launches.log"
  timeout 70 python -m recipes.bench.throughput --bench.out="$OUT/traced.jsonl" --bench.reference \
    --activation_checkpoint.mode none --bench.batches $REF_SEQS --model.kernels liger \
    --model.flavor $FLAVOR --training.max_norm 1.0 --training.steps 3 --bench.label reference-traced \
    --bench.trace_dir "$OUT/trace_ref" >> "$OUT/launches.log" 2>&1; echo "rc $?" | tee -a "$OUT/launches.log"
  tar cf "$OUT/traces.tar" -C "$OUT" trace trace_ref 2>/dev/null && rm -rf "$OUT/trace" "$OUT/trace_ref"
fi
log done
python -m recipes.bench.headline "$OUT"/after.jsonl "$OUT"/before.jsonl 2>&1 | tail -8
