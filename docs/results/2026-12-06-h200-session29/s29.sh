#!/usr/bin/env bash
# Session 29 (2026-12-06) on one GPU, FLAVOR (Qwen3-4B) at clipping 1.0, every unit's optimizer state
# resident on the GPU, `keep`, `next_use`. Stages, run in the order given:
#   check  the correctness stage (tests/test_gpu_options.py -k "base or resident"); a failure
#          stops the script before anything is measured
#   ref    SlideDP at SEQS sequences and the no-recompute reference at REF_SEQS, both timed
#          `window` (as the training loop runs), interleaved, LAUNCHES each: issue 28's ratio
#   old    issue 26's before/after: this tree against .old (git archive 2ccb66f, its bench's
#          old flag names), both timed as the old bench times (`step`), interleaved
#   fsdp2  FSDP2's peak at clipping 1.0, as recipes/bench/suites/fsdp2_peak_4b.toml takes it:
#          `none` at 2, 4, 5 and `selective` at 4, 8, one launch each, the fastest twice more
#   probe  the probe's rates of FLAVOR at REF_SEQS sequences (blocks timed at the run's batch)
#   [FLAVOR=qwen3-4B BLOCKS=36 SEQS=4,1 REF_SEQS=4 LAUNCHES=3] bash s29.sh OUT STAGE...
set -u
OUT=$1; shift
LAUNCHES=${LAUNCHES:-3} FLAVOR=${FLAVOR:-qwen3-4B} BLOCKS=${BLOCKS:-36} SEQS=${SEQS:-4,1}
REF_SEQS=${REF_SEQS:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$(nproc)
[ -f "$OUT/host.txt" ] || (nvidia-smi; nproc; lscpu | grep 'Model name'; free -g;
  python -c "import torch; print(torch.__version__)") > "$OUT/host.txt" 2>&1
log() { echo "=== $* $(date +%T)" | tee -a "$OUT/launches.log"; }
run() {  # LIMIT DIR ARGS...: one launch of the bench from DIR (. or .old)
  local limit=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=.:${PYTHONPATH:-} timeout "$limit" python -m recipes.bench.throughput "$@") \
    >> "$OUT/launches.log" 2>&1
  echo "rc $?" | tee -a "$OUT/launches.log"
}
NEW="--parallelism.mode slidedp --model.kernels liger --model.flavor $FLAVOR --training.max_norm 1.0
  --slidedp.check_host_memory=false --bench.warmup 1 --training.steps 3 --training.nonfinite skip
  --slidedp.embedding_update resident --slidedp.update_order next_use --slidedp.gpu_state_blocks $BLOCKS
  --bench.points keep:$SEQS"
OLD="--mode slidedp --kernels liger --flavor $FLAVOR --max-norm 1.0 --no-memory-check --warmup 1
  --steps 3 --nonfinite skip --embedding-update resident --update-order next_use
  --gpu-state-blocks $BLOCKS --points keep:$SEQS"
REF="--bench.reference --activation_checkpoint.mode none --bench.batches $REF_SEQS --model.kernels liger
  --model.flavor $FLAVOR --training.max_norm 1.0 --training.steps 3"
for stage in "$@"; do
  case $stage in
  check)
    log correctness
    if ! timeout 200 python -m pytest -q -rA -s --durations=0 --tb=short tests/test_gpu_options.py \
        -k "base or resident" > "$OUT/correctness.log" 2>&1; then
      echo "correctness stage failed: nothing measured"; tail -30 "$OUT/correctness.log"; exit 1
    fi
    tail -2 "$OUT/correctness.log" ;;
  ref)
    for i in $(seq 1 "$LAUNCHES"); do
      log "ref: slidedp $i"; run 90 . --bench.out="$OUT/ref.jsonl" $NEW --bench.label resident-all --bench.launch=$i
      log "ref: reference $i"; run 45 . --bench.out="$OUT/ref.jsonl" $REF --bench.label reference --bench.launch=$i
    done
    python -m recipes.bench.headline "$OUT/ref.jsonl" 2>&1 | tail -12 ;;
  old)
    for i in $(seq 1 "$LAUNCHES"); do
      log "old: after $i"; run 90 . --bench.out="$OUT/old.jsonl" $NEW --bench.sync step --bench.label after-step --bench.launch=$i
      log "old: before $i"; run 90 .old --out "$OUT/old.jsonl" $OLD --label before-old --launch $i
    done
    python -m recipes.bench.headline "$OUT/old.jsonl" 2>&1 | tail -8 ;;
  fsdp2)
    FS="--parallelism.mode fsdp2 --model.kernels liger --model.flavor $FLAVOR --training.max_norm 1.0
      --training.steps 3 --bench.out=$OUT/fsdp2.jsonl"
    log "fsdp2 sweep"
    run 60 . $FS --bench.label fsdp2-sweep --activation_checkpoint.mode none --bench.batches 2 4 5
    run 60 . $FS --bench.label fsdp2-sweep --activation_checkpoint.mode selective --bench.batches 4 8
    best=$(python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; r=[x for x in r if x['valid']]; b=max(r,key=lambda x:x['tokens_per_s']); print(b['ac'], b['local_batch'])" "$OUT/fsdp2.jsonl")
    log "fsdp2 peak: $best"
    for i in 2 3; do
      run 45 . $FS --bench.label fsdp2-peak --bench.launch=$i --activation_checkpoint.mode ${best% *} --bench.batches ${best#* }
    done ;;
  probe)
    log probe
    SLIDEDP_RATES_DIR=/tmp/rates timeout 120 python -m recipes.probe train_configs/h200_qwen3_4b_slidedp.toml \
      --model.flavor=$FLAVOR --slidedp.autopolicy_candidates=keep --training.local_batch_size=$REF_SEQS \
      --out "$OUT/rates.json" \
      > "$OUT/probe.log" 2>&1; echo "rc $?"; tail -4 "$OUT/probe.log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
log done
