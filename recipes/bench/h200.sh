#!/usr/bin/env bash
# The GPU-machine runs behind docs/PERFORMANCE.md and the dated folders under docs/results/,
# stage by stage:
#   bash recipes/bench/h200.sh OUT_DIR STAGE [STAGE ...]
# Every call first runs the correctness stage (below, before the stage loop).
# Stages: env adam gputest smoke reference fsdp2 slidedp slidedpkeep slidedpsac fsdp2max slidedpcpu
#         ncclctas reftrace recompute cpu16 clip clip1 slidedpmax refmax fsdp2same peak fsdp2_14 slidedp14
#         fused-kernel stages (one H200, both [model] kernels side by side):
#         kgputest attn actbytes ref4b ref8b refliger fsdp4b slidedp4b same4b slidedp8b slidedp8bplain
#         hf (Hugging Face's Qwen3 + liger next to our reference, the fused-kernels targets)
#         policies4b policies4bmore policies4bslidedp (Qwen3-4B: both references and FSDP2 over its checkpointing;
#         SlideDP's policies)
#         long context: long4b long8b (one 262,144-token sequence, YaRN x8 over 32,768)
#         host memory, the update order and the CPU Adam threads (one H200): clip8b tail4b threads8b
#         the embedding's update on the GPU (one H200, issue 10's targets): embed
#         baselines: sac4b offload4b offload8b dsinstall zero4b zero8b h2h (the head-to-head, one lease)
#         the paper's experiments on one H200 after h2h: paper1 paper2 paper3 peers peers2; mix16 (a profile);
#         the offloading baselines: offload offload2 (after dsinstall)
#         paper experiments: reproduce-NAME for each recipes/reproduce/NAME.py (into OUT_DIR/NAME/)
#         the re-measurement after issue 25's fix (one H200): remeasure4b fsdp2peak4b remeasure8b
#         the step-time model: plan (probe, predictions, the same points measured, AutoPolicy)
#         issue 14, 2-8 GPUs of one host (one device call per machine kind, below): multi8b multi14b
#         strong14b weak32b routes14b routes14b8 million castcopy, then compare (the predictions beside
#         the rows)
#         (each appends to OUT_DIR/runs.jsonl; traces go to OUT_DIR).
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# NGPU (default: every GPU found): the ranks; set, it checks a stage's launches on the CPU (BENCH_FLAGS).
ngpu=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
export OMP_NUM_THREADS=$(( $(nproc) > ngpu ? $(nproc) / ngpu : 1 ))
bench=(torchrun --standalone --nproc_per_node="$ngpu" -m recipes.bench.throughput --out "$out/runs.jsonl")
run() { "${bench[@]}" "$@"; }
# largest SECONDS "B1 B2 ..." ARGS...: the first of the batch sizes that runs (an out-of-memory rank
# can leave its peer waiting in a collective, hence the time limit on each try).
largest() {
  local limit=$1 sizes=$2; shift 2
  for b in $sizes; do
    timeout "$limit" "${bench[@]}" --batches "$b" "$@" && return
    echo "$* at $b sequences per GPU failed (out of memory?)"
  done
}
# long_context FLAVOR: one 262,144-token sequence. Qwen3's cards give YaRN x4 over 32,768 native
# positions for 131,072; 262,144 takes x8 (our choice, beyond the 131,072 Qwen validated). Full
# recompute (the block-boundary states alone are 2 x dim bytes/token/block: 45 GiB for 4B, 72 GiB
# for 8B), no clipping, one timed step after the bench's own warm-up step (SlideDP's first
# update cycle; `--warmup 0` adds none): two steps of minutes each. First attention
# alone at that length (the run's default order, and flash), then the step-time model's
# prediction with the rate measured there (written before the step runs), then the step on the
# faster backend, with expandable segments: the card runs at its memory limit, where a cached
# allocator's fragments cost retries and frees.
long_context() {
  local flavor=$1 seq=262144 rows="$out/attention_$1_262k.jsonl" backend
  python3 -m recipes.bench.attention --flavor "$flavor" --seq $seq --batches 1 --iters 1 \
    --warmup 1 --backends auto,flash --out "$rows"
  backend=$(python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(max((r for r in rows if "tflops" in r), key=lambda r: r["tflops"])["backend"])' "$rows") \
    || backend=auto
  python3 -m recipes.bench.model_check predict --rates h200 --flavor "$flavor" --seq $seq \
    --kernels liger --points recompute:1 --attention-rows "$rows" --attention "$backend" \
    --out "$out/long_predicted.jsonl"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${LONG_SECONDS:-590}" "${bench[@]}" \
    --mode slidedp --kernels liger --flavor "$flavor" --seq $seq --attention "$backend" \
    --rope-scaling-type yarn --rope-scaling-factor 8 --original-max-position-embeddings 32768 \
    --points recompute:1 --max-norm 0 --no-memory-check --warmup 0 --steps 1 --label yarn8-262k
  python3 -m recipes.bench.model_check compare "$out/long_predicted.jsonl" "$out/runs.jsonl"
}
# plan: the step-time model and AutoPolicy against measurement (issues 10 and 11) on one H200, in
# about 9 minutes, most important first. Qwen3-8B with clipping: the hand-picked mixes at 16 and
# 24 sequences, keep at 2 (host-bound), AutoPolicy at 24; Qwen3-4B: keep at 1 (host-bound), the
# best hand-picked segment mask of calls 4-6 at 8, AutoPolicy at 8; then FSDP2's and the
# no-recompute reference's best 4B points of calls 4-6, in the same lease. The predictions come
# from the shipped rates file (slidedp/plan/rates/h200.json) and are written before the call
# (PLAN_PREDICTED, made by `model_check predict`); AutoPolicy probes this machine itself. Every
# sub-run has its own time limit, cut to what is left of the stage's PLAN_SECONDS; a run cut
# short keeps the rows it emitted.
PLAN_SECONDS=${PLAN_SECONDS:-560}
SEG5="segments(qkv+attention_core+o_proj+mlp_up+down_proj)"
within() {  # within SECONDS CMD...: CMD under min(SECONDS, what is left before stage_end)
  local limit=$1 left=$(( stage_end - SECONDS )) rc; shift
  if (( left < 10 )); then echo "out of time, skipped: $*"; return 1; fi
  timeout --kill-after=15 $(( limit < left ? limit : left )) "$@"
  rc=$?
  (( rc == 124 || rc == 137 )) && settle
  return $rc
}
# settle: after a launch was killed, wait (up to 60 s) until no process holds the GPU and host
# memory stops coming back (under 1 GiB in 2 s), so the next launch does not start while the
# killed one still frees its memory (in call 18 the first launch after a killed ZeRO-2 launch,
# whose rank reaches 73 GiB of host memory, ran its host AdamW ~40% slower than the same updates
# later in the lease; the cause is not established).
settle() {
  local waited=0 before after
  after=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
  while (( waited < 60 )); do
    sleep 2; waited=$(( waited + 2 ))
    before=$after; after=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
    if [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null) ]] \
        && (( after - before < 1048576 )); then break; fi
  done
  echo "settled after ${waited} s; MemAvailable $(( after / 1048576 )) GiB"
}
plan_measure() {  # plan_measure SECONDS BENCH-ARGS...
  within "$1" "${bench[@]}" --kernels liger --no-memory-check --warmup 1 --steps 2 "${@:2}"
}
plan_stage() {
  stage_end=$(( SECONDS + PLAN_SECONDS ))
  local auto=(--autopolicy-steps 2)
  plan_measure 300 --mode slidedp --flavor qwen3-8B --max-norm 1.0 --points "selective|0-8:keep:16" \
    "selective|0-3:keep:24" keep:2 "${auto[@]}" --autopolicy 24 --autopolicy-candidates "keep, selective"
  plan_measure 130 --mode slidedp --flavor qwen3-4B --max-norm 0 --points keep:1 "$SEG5:8" \
    "${auto[@]}" --autopolicy 8 --autopolicy-candidates "keep, selective, $SEG5"
  plan_measure 60 --mode fsdp2 --flavor qwen3-4B --max-norm 0 --ac selective --batches 8
  plan_measure 50 --mode reference --flavor qwen3-4B --max-norm 0 --ac none --batches 8
  python3 -m recipes.bench.model_check compare "${PLAN_PREDICTED:?the predictions file}" "$out/runs.jsonl"
}
# The paper's experiments on one H200 (issue 13), in calls of about 9 minutes after `h2h` in
# the same lease (its ZeRO-Offload and SlideDP rows complete these tables afterwards through
# the scripts' --rows). Each script writes into PAPER_DIR/NAME (default OUT_DIR) and runs under
# its own limit, cut to what is left of PAPER_SECONDS; one cut short keeps the rows it wrote
# (its runs.jsonl), from which --rows makes its table later. With PAPER_TAR, the folder is packed
# into that file after each script (the device returns 8 files at most). REPRODUCE_ARGS is
# appended to every script (e.g. --systems, --timeout; --tiny, to check a stage on the CPU).
paper() {  # paper SECONDS NAME ARGS...
  local limit=$1 name=$2; shift 2
  # shellcheck disable=SC2086  # REPRODUCE_ARGS is a list of flags
  within "$limit" python3 -m "recipes.reproduce.$name" --kernels liger \
    --out-dir "${PAPER_DIR:-$out}/$name" "$@" ${REPRODUCE_ARGS:-}
  if [[ -n ${PAPER_TAR:-} ]]; then tar czf "$PAPER_TAR" -C "${PAPER_DIR:-$out}" .; fi
}
# paper1: CPU Adam against threads with the STREAM triad; the batch sweep of SlideDP (full
# recompute), FSDP2 (full AC) and the reference at 1-16 sequences; activation policies at 4 and
# 16 sequences (SlideDP's three, FSDP2's none and selective; FSDP2's full comes from the sweep).
paper1() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-560} ))
  paper 90 cpu_adam_scaling
  paper 250 batch_sweep --systems slidedp-recompute,fsdp2-full,reference-full --batches 1,2,4,8,16 \
    --timeout 120
  paper 220 activation_policy --systems fsdp2-none,fsdp2-selective --batches 4,16 --timeout 110
}
# paper2: CPU Adam against threads again (the triad now STREAM's loop on our threads), the four
# routes at 8 sequences (one GPU: nothing to shard or reduce, so the same bytes), then the GPU
# tests (call 22 cut them; call 23 ran them). paper3: the chunk size at 4 sequences without
# clipping (where returns overlap the updates). A chunk size is one build: in call 23 each took
# over 60 s (a 37 s build, then the first update cycle's page faults), so each gets 100 (call 26:
# 70-78 s). Long context ran 32K and 64K in call 20, 131K in call 23 (`reproduce-long_context`
# runs it again).
paper2() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-300} ))
  paper 80 cpu_adam_scaling
  paper 110 routes --batches 8
  within 100 python3 -m pytest -q -rs tests/test_slidedp.py tests/test_kernels.py -k "gpu or fused"
}
paper3() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-330} ))
  paper 320 chunk_sweep --chunks 8,32,128 --batch 4 --activation keep --max-norm 0 --timeout 100
}
# peers, peers2: the SlideFormer- and MegaTrain-style peers (re-implementations as policies of our
# runtime, slidedp/peer_styles.py) at matched batches (Qwen3-4B, clipping at 1.0) beside SlideDP's
# best settings per batch of calls 18-20, in one lease: two calls, peers2 right after peers (then
# paper3 as a third). The limits are what calls 25-27 needed: a launch takes a ~40 s build (the
# first one also compiles the CPU Adam), then 3-6 s per step; SlideDP's `keep` at 4 and 8 took
# 93 s, SlideFormer-style `keep` at 4 and 8 104 s, MegaTrain-style `recompute` at 8 and 16 115 s.
# Rows are labelled with recipes/reproduce's system names: `head_to_head --rows` makes the table.
# The head-to-head's workload, shared by `h2h` and the peers: Qwen3-4B, seq 4096, clipping at 1.0.
H2H=(--kernels liger --flavor qwen3-4B --seq 4096 --max-norm 1.0 --steps 2 --warmup 1 --no-memory-check)
labelled() {  # labelled SECONDS LABEL BATCHES BENCH-ARGS...: one launch of the H2H workload
  local limit=$1 label=$2 batches=$3; shift 3
  # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags (a CPU check, as for issue 14's)
  within "$limit" "${bench[@]}" "${H2H[@]}" --batches "$batches" --label "$label" "$@" ${BENCH_FLAGS:-}
}
peer() {  # peer SECONDS LABEL BATCHES BENCH-ARGS...: a SlideDP-runtime launch
  local limit=$1 label=$2 batches=$3; shift 3
  labelled "$limit" "$label" "$batches" --mode slidedp "$@"
}
slidedp_best() {  # SlideDP's best measured setting per batch, 1-16 sequences (300 s)
  peer 100 slidedp-recompute 1,2 --activation recompute
  peer 120 slidedp-keep-gpuembed 4,8 --activation keep --embedding-update gpu
  peer 80 slidedp-selective-keep14-gpuembed 16 --activation selective --keep-blocks 14 \
    --embedding-update gpu
}
peers() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-570} ))
  slidedp_best
  peer 130 slideformer-recompute 1,2,4,8,16 --runtime slideformer --activation recompute
  peer 130 megatrain-recompute 1,2,4 --runtime megatrain --activation recompute
}
peers2() {  # `keep` at 16 does not fit
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-570} ))
  peer 180 slideformer-keep 1,2,4,8 --runtime slideformer --activation keep
  peer 170 megatrain-recompute 8,16 --runtime megatrain --activation recompute
  peer 200 megatrain-keep 1,2,4,8 --runtime megatrain --activation keep
}
# offload, offload2: the two sharded offloading baselines, FSDP2 with CPUOffloadPolicy and
# DeepSpeed ZeRO-3 Offload (full AC, the head-to-head's workload, labelled with recipes/reproduce's
# system names), then SlideDP's best per batch in the same lease (the next call), for
# `head_to_head --rows` and `batch_sweep --rows`. offload needs dsinstall first (DeepSpeed's first
# launch JIT-builds its CPU Adam: ZeRO-3's built in 144 s). Calls 29-30: every point, in 478 s
# (dsinstall included) and 284 s.
offload() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-570} ))
  labelled 270 fsdp2-offload 1,2,4,8,16 --mode fsdp2 --ac full --fsdp-cpu-offload
  labelled 300 zero3-offload 1,2,4,8,16 --mode deepspeed --zero-stage 3 --ac full
}
offload2() {
  stage_end=$(( SECONDS + ${PAPER_SECONDS:-310} ))
  slidedp_best
}
# Issue 14: 2, 4 and 8 H200s of one host (nvidia-h200-x2, -x4, -x8), one device call of about 9
# minutes per machine kind (docs/results/issue14_plan.md has each call and its predictions,
# docs/results/h200x{2,4,8}_issue14_predicted.jsonl, written before it). Every sub-run of these
# stages has its own time limit, cut to what is left of one deadline shared by the call
# (MULTI_SECONDS from the first of them), so the stages named first get the time; a run cut
# short keeps the rows it emitted, a later one is skipped with a line. A stage runs on the GPU
# counts it names (ranks on GPUs 0..n-1), skipping those this machine lacks. The scaling and
# route rows carry recipes/reproduce's system names as labels, so its scripts make the paper's
# tables from them afterwards (--rows). The durations quoted are PREDICTED: the model's step
# times, ~20 s to launch, a build of ~0.5 s per GiB of host state per rank (as on the 2xH200).
# BENCH_FLAGS is appended to every launch (later flags win), to check a stage on the CPU:
#   NGPU=2 BENCH_FLAGS="--kernels torch --flavor qwen3-debug --seq 64 --warmup 0 --steps 1" \
#     bash recipes/bench/h200.sh OUT multi8b
MULTI_SECONDS=${MULTI_SECONDS:-550}
multi_deadline() { : "${multi_end:=$(( SECONDS + MULTI_SECONDS ))}"; stage_end=$multi_end; }
on_gpus() {  # on_gpus N SECONDS BENCH-ARGS...: the bench on N ranks, under `within SECONDS`
  local n=$1 limit=$2; shift 2
  if (( n > ngpu )); then echo "skipped, needs $n GPUs: $*"; return 1; fi
  # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
  within "$limit" "${bench[@]/#--nproc_per_node=*/--nproc_per_node=$n}" --kernels liger "$@" ${BENCH_FLAGS:-}
}
# multi8b, item 1 on 2 GPUs (about 440-490 s): Qwen3-8B, seq 4096, clipping at 1.0 as FSDP2 runs
# it. FSDP2 over its checkpointing at the batches its memory estimate allows (the last of each
# may run out of memory, which ends that launch), then SlideDP in one build: the best
# hand-picked mixes of the one-H200 runs at 16 and 24 (predicted 6.58 and 10.04 s) and
# AutoPolicy at 16 over keep, selective and the offloaded op-level save the offline search
# picks (about 150-200 s of selection). `compare` sets every row against FSDP2's peak (the
# target: SlideDP >= 1.25x).
multi8b() {
  multi_deadline
  on_gpus 2 60 --mode fsdp2 --flavor qwen3-8B --ac none --batches 1,2,3,4
  on_gpus 2 70 --mode fsdp2 --flavor qwen3-8B --ac selective --batches 2,4,6,8
  on_gpus 2 110 --mode fsdp2 --flavor qwen3-8B --ac full --batches 16,32
  on_gpus 2 330 --mode slidedp --flavor qwen3-8B --no-memory-check --warmup 0 \
    --points "selective|0-8:keep:16" "selective|0-3:keep:24" --autopolicy 16 --autopolicy-steps 2 \
    --autopolicy-candidates "keep, selective, ops(matmul+attention)@offload=1.0"
}
# multi14b, item 1's Qwen3-14B on 2 GPUs (about 240 s): SlideDP's hand-picked mix at 16
# (predicted 12.31 s), then FSDP2 at its measured peak (full, 8) and beyond, selective, none.
multi14b() {
  multi_deadline
  on_gpus 2 150 --mode slidedp --flavor qwen3-14B --no-memory-check --warmup 0 \
    --points "selective|0-2:keep:16"
  on_gpus 2 90 --mode fsdp2 --flavor qwen3-14B --ac full --batches 8,12
  on_gpus 2 60 --mode fsdp2 --flavor qwen3-14B --ac selective --batches 1,2,3
  on_gpus 2 45 --mode fsdp2 --flavor qwen3-14B --ac none --batches 1
}
# strong14b, item 3: Qwen3-14B at a global batch of 256 sequences of 512 tokens (the length our
# predictions of the paper assume, docs/RESULTS.md section 2: at 4,096 its 29.6 s on 4 A800s
# would need 3x their peak), no clipping, full recompute, on STRONG_GPUS (the paper's 8 and 4):
# per count SlideDP, the SlideFormer-style runtime and the compute reference (reproduce/scaling's
# systems). 128 x 512 tokens per GPU fit without accumulation even on 2 GPUs. About 145 s on 8
# GPUs (predicted steps 3.07 / 6.90 / 2.95 s), 185 s on 4 (6.01 / 6.20 / 5.89 s), 280 s on 2.
strong14b() {
  multi_deadline
  local n common
  for n in ${STRONG_GPUS:-8 4}; do
    common=(--flavor qwen3-14B --seq 512 --max-norm 0 --batches $(( 256 / n )))
    on_gpus "$n" 120 --mode slidedp --activation recompute --no-memory-check --warmup 0 \
      --label slidedp-recompute "${common[@]}"
    on_gpus "$n" 130 --mode slidedp --runtime slideformer --activation recompute --no-memory-check \
      --warmup 0 --label slideformer-recompute "${common[@]}"
    on_gpus "$n" 60 --mode reference --ac full --label reference-full "${common[@]}"
  done
}
# weak32b, items 4 and 6 (Qwen3-32B on 8): 64 sequences of 512 tokens per GPU on WEAK_GPUS,
# no clipping, full recompute (predicted 13.70-13.72 s per step on 8, 4 and 2). Its 427 GiB
# of host state is checked at start (no --no-memory-check), so the x2's 251 GiB refuses in one
# line. 64 x 4,096 tokens per GPU would need accumulation, whose FP32 buffer makes the host
# state 549 GiB: more than the x8's. About 90 s on 8 GPUs, 120 s on 4, 175 s on 2 (the build).
weak32b() {
  multi_deadline
  local n
  for n in ${WEAK_GPUS:-8 4 2}; do
    on_gpus "$n" 200 --mode slidedp --activation recompute --flavor qwen3-32B --seq 512 \
      --batches 64 --max-norm 0 --warmup 0 --label slidedp-recompute
  done
}
# routes14b, item 2 (about 160 s): sharded against replicated delivery, both reducing on the
# GPUs, Qwen3-14B at 8 and 16 sequences of 4,096 tokens per GPU on 4 GPUs (predicted 6.38 /
# 12.60 s sharded, 6.40 / 12.62 replicated: within 0.4%), full recompute, no clipping, one build
# (reproduce/routes' label). routes14b8: 64 per GPU on 8, GPU-bound (the paper: under 2.5%
# apart; predicted 49.90 / 49.94 s), one timed step each, about 235 s.
routes() {  # routes N BATCHES SECONDS BENCH-ARGS...
  multi_deadline
  on_gpus "$1" "$3" --mode slidedp --activation recompute --flavor qwen3-14B --max-norm 0 \
    --routes sharded/gpu,replicated/gpu --batches "$2" --no-memory-check --warmup 0 --label routes "${@:4}"
}
# million, item 6: 256 sequences of 4,096 tokens per step (1,048,576) without accumulation,
# Qwen3-14B, clipping at 1.0: 32 per GPU on 8 GPUs (recompute, predicted 25.0 s, about 85 s),
# else 64 per GPU on 4, with half of each block's saved input offloaded to host memory (the
# estimate: 129 of 140 GiB per GPU, 178 recomputing all on the GPU; 393 GiB of host; predicted
# 49.9 s, about 155 s).
million() {
  multi_deadline
  local common=(--mode slidedp --flavor qwen3-14B --no-memory-check --warmup 0 --steps 1 --label million)
  if (( ngpu >= 8 )); then
    on_gpus 8 150 "${common[@]}" --points recompute:32
  else
    on_gpus 4 240 "${common[@]}" --points "recompute@offload=0.5:64"
  fi
}
# castcopy, item 5 (about 25 s per count): host amplification from the probe
# (slidedp/plan/probe.py), which times pinned H2D and D2H per GPU with one GPU copying and with
# all of its ranks at once, and on rank 0 the cast, Adam and triad by thread count: on 1, 2, 4
# and 8 ranks (CASTCOPY_GPUS), each into castcopy_xN.json (the debug model on the torch kernels
# for its block timings: no Triton compile), then paper_points' cast-and-copy table from them.
castcopy() {
  multi_deadline
  local n
  for n in ${CASTCOPY_GPUS:-1 2 4 8}; do
    (( n <= ngpu )) || continue
    within 60 env SLIDEDP_RATES_DIR="$out/probe_cache" torchrun --standalone --nproc_per_node="$n" \
      -m recipes.probe --model.flavor=qwen3-debug --model.kernels=torch --training.seq_len=256 \
      --slidedp.autopolicy_candidates=recompute --out "$out/castcopy_x$n.json"
  done
  python3 -m recipes.bench.paper_points --cast-and-copy "$out"/castcopy_x*.json
}
# The correctness stage runs first in every call (docs/PERFORMANCE.md's rules): each SlideDP
# option the docs measure trains as `single` does on this GPU (tests/test_gpu_options.py), and the
# embedding's update on the GPU at the shipped 4B config's micro-batches (tests/test_gpu_update.py;
# its untied 7B case takes 70 s more: `gputest` runs the whole file). A call whose check fails
# measures nothing.
CHECKS=(tests/test_gpu_options.py
        tests/test_gpu_update.py::test_prefetch_waits_for_kernels_queued_on_the_memory_it_reuses
        "tests/test_gpu_update.py::test_embedding_update_trains_as_single_at_real_size[gpu-1.0-qwen3-4B-8x8x4096]")
echo "=== correctness $(date +%T)"
timeout "${CORRECTNESS_SECONDS:-300}" python3 -m pytest -q -rA -s --durations=0 "${CHECKS[@]}" \
  > "$out/correctness.log" 2>&1
rc=$?
grep -E "PASSED|FAILED|ERROR|passed|failed|weight diff" "$out/correctness.log"
if (( rc != 0 )); then echo "correctness failed (rc $rc, $out/correctness.log): nothing measured"; exit 1; fi
# launches N SECONDS BENCH-ARGS...: N launches of one point, each a build of its own, for a
# headline's median and spread (`python3 -m recipes.bench.headline`).
launches() {
  local n=$1 limit=$2 i; shift 2
  for (( i = 1; i <= n; i++ )); do within "$limit" "${bench[@]}" "$@" --launch "$i"; done
}
# remeasure: the figures that came from the embedding's update on the GPU, after the fix, each a
# median of 3 launches in this machine start beside what it is set against, at clipping 1.0.
# remeasure4b: Qwen3-4B, the no-recompute reference at its measured best (4 sequences), the
# shipped config's point (16 sequences, blocks 0-13 keep, the rest selective) with the embedding
# updated on the GPU, then once on the host (a launch: a ~45 s build, then ~70 s of steps).
# fsdp2peak4b: FSDP2's peak at the same clipping (`none` and `selective` over their batches, one
# launch each, `full` being the slower wherever the others fit; then its best point twice more).
# remeasure8b: Qwen3-8B, the fused reference (HF + liger at 3 sequences), SlideDP's point of
# issue 10 (16 sequences, blocks 0-9 keep, 28-35 selective, 2 slots) with the host update, then
# the GPU's.
SD4=(--mode slidedp --kernels liger --flavor qwen3-4B --max-norm 1.0 --no-memory-check --warmup 1
     --steps 3 --nonfinite skip --points "selective|0-13:keep:16")
SD8=(--mode slidedp --kernels liger --flavor qwen3-8B --max-norm 1.0 --no-memory-check --warmup 1
     --steps 3 --nonfinite skip --slots 2 --points "recompute|0-9:keep, 28-35:selective:16")
remeasure4b() {
  stage_end=$(( SECONDS + ${REMEASURE_SECONDS:-420} ))
  launches 3 60 --mode reference --ac none --batches 4 --kernels liger --flavor qwen3-4B \
    --max-norm 1.0 --steps 3 --label reference
  launches 3 130 "${SD4[@]}" --embedding-update gpu --label shipped-gpuembed
  launches 1 130 "${SD4[@]}" --embedding-update host --label shipped-hostembed
}
fsdp2peak4b() {
  stage_end=$(( SECONDS + ${FSDP_SECONDS:-300} ))
  local fs=(--mode fsdp2 --kernels liger --flavor qwen3-4B --max-norm 1.0 --steps 3) best
  within 60 "${bench[@]}" "${fs[@]}" --ac none --batches 2,4,5 --label fsdp2-sweep --launch 1
  within 60 "${bench[@]}" "${fs[@]}" --ac selective --batches 4,8 --label fsdp2-sweep --launch 1
  best=$(python3 -c 'import sys; from recipes.bench.headline import best_point
print(best_point(sys.argv[1], mode="fsdp2", label="fsdp2-sweep"))' "$out/runs.jsonl") || return 1
  echo "FSDP2's best point: $best"
  # shellcheck disable=SC2086  # best: "--ac AC --batches B"
  for i in 2 3; do within 45 "${bench[@]}" "${fs[@]}" $best --label fsdp2-sweep --launch $i; done
}
remeasure8b() {
  stage_end=$(( SECONDS + ${REMEASURE_SECONDS:-500} ))
  local i
  for i in 1 2 3; do within 80 python3 -m recipes.bench.hf_reference --liger --flavor qwen3-8B \
    --batches 3 --steps 3 --launch $i --out "$out/runs.jsonl"; done
  launches 3 130 "${SD8[@]}" --embedding-update host --label issue10-hostembed
  launches 1 130 "${SD8[@]}" --embedding-update gpu --label issue10-gpuembed
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nproc; free -g; df -h /dev/shm; ulimit -l; nvidia-smi --query-gpu=name,memory.total --format=csv
         python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'
         grep -E 'MemTotal|MemAvailable|Shmem:' /proc/meminfo; nvidia-smi topo -m | head -4 ;;
    adam) python3 -m recipes.bench.cpu_adam --params 200e6 --threads 1,2,4,8,16,32 --json "$out/cpu_adam.json" ;;
    gputest) python3 -m pytest -q -x tests/test_slidedp.py tests/test_gpu_update.py -k gpu ;;
    smoke) run --mode slidedp --batches 4 --routes sharded/gpu --max-norm 0 --no-memory-check --steps 1 \
             --flavor qwen3-8B ;;
    reference) run --mode reference --ac full --batches 16,32 --flavor qwen3-8B ;;
    fsdp2) run --mode fsdp2 --ac full --batches 8,16,24 --flavor qwen3-8B ;;
    slidedp) run --mode slidedp --batches 16,32 --routes sharded/gpu,replicated/gpu --max-norm 0 --no-memory-check \
               --flavor qwen3-8B ;;
    slidedpkeep) run --mode slidedp --batches 16 --routes sharded/gpu --max-norm 0 --no-memory-check \
                   --keep-blocks 6 --label keep6 --flavor qwen3-8B ;;
    slidedpsac) run --mode slidedp --batches 16 --routes sharded/gpu,replicated/gpu --max-norm 0 \
                  --no-memory-check --activation selective --keep-blocks 4 --label sel+keep4 --flavor qwen3-8B ;;
    fsdp2max) largest 150 "32 28" --mode fsdp2 --ac full --flavor qwen3-8B ;;  # FSDP2's largest batch
    slidedpcpu) run --mode slidedp --batches 16,32 --routes sharded/cpu,replicated/cpu --max-norm 0 \
                  --no-memory-check --trace-dir "$out" --trace-batch 16 --flavor qwen3-8B ;;
    ncclctas) # A/B of the proportional overhead: fewer SMs for the collectives that overlap compute.
              NCCL_MAX_CTAS=4 run --mode slidedp --batches 16 --routes sharded/gpu --max-norm 0 \
                --no-memory-check --label nccl-max-ctas-4 --flavor qwen3-8B ;;
    # The next four trace 16 sequences per GPU (one more, profiled step after the timed ones).
    reftrace) run --mode reference --ac full --batches 16,32 --trace-dir "$out" --trace-batch 16 \
                --flavor qwen3-8B ;;
    recompute) run --mode slidedp --batches 16,32 --routes sharded/gpu --max-norm 0 --no-memory-check \
                 --trace-dir "$out" --trace-batch 16 --flavor qwen3-8B ;;
    cpu16) run --mode slidedp --batches 16 --routes sharded/cpu,replicated/cpu --max-norm 0 \
             --no-memory-check --trace-dir "$out" --flavor qwen3-8B ;;
    clip) run --mode slidedp --batches 16 --accum 1,2 --routes sharded/gpu --max-norm 1.0 --no-memory-check \
            --trace-dir "$out" --label clip --flavor qwen3-8B ;;
    clip1) run --mode slidedp --batches 16 --routes sharded/gpu --max-norm 1.0 --no-memory-check --label clip \
             --flavor qwen3-8B ;;
    slidedpmax) largest 200 "56 48 40" --mode slidedp --routes sharded/gpu --max-norm 0 --no-memory-check \
                  --flavor qwen3-8B ;;  # SlideDP's largest batch under full recompute
    refmax) largest 150 "48 40" --mode reference --ac full --flavor qwen3-8B ;;  # the reference there
    fsdp2same) run --mode fsdp2 --ac full --batches 16,32 --flavor qwen3-8B ;;  # SlideDP's batches; 32 is its largest
    peak) # FSDP2's largest batch next to SlideDP's best setting, in one lease.
          run --mode fsdp2 --ac full --batches 32 --label same-run --flavor qwen3-8B
          run --mode slidedp --batches 16 --routes replicated/gpu --max-norm 0 --no-memory-check \
            --activation selective --keep-blocks 4 --label same-run --flavor qwen3-8B ;;
    fsdp2_14) run --mode fsdp2 --ac full --batches 8 --flavor qwen3-14B ;;
    slidedp14) run --mode slidedp --batches 16 --routes sharded/gpu --max-norm 0 --no-memory-check \
                 --activation selective --flavor qwen3-14B ;;
    kgputest) python3 -m pytest -q -rs tests/test_kernels.py ;;
    attn) for f in qwen3-4B qwen3-8B; do
            python3 -m recipes.bench.attention --flavor $f --batches 1,4 --out "$out/attention.jsonl"; done ;;
    actbytes) for f in qwen3-4B qwen3-8B; do
                python3 -m recipes.bench.activations --flavor $f --out "$out/activations.jsonl"; done ;;
    # The compute reference on both kernel paths; the batches that may not fit come last.
    ref4b) run --mode reference --ac none --batches 1,2,4 --kernels torch --flavor qwen3-4B
           run --mode reference --ac full --batches 16 --kernels torch --flavor qwen3-4B
           run --mode reference --ac none --batches 1,2,4,6 --kernels liger --flavor qwen3-4B
           run --mode reference --ac full --batches 16,32 --kernels liger --flavor qwen3-4B
           run --mode reference --ac none --batches 4 --kernels liger --attention flash --label flash \
             --flavor qwen3-4B ;;  # the model with flash attention instead of auto's order
    refliger) run --mode reference --ac none --batches 1,2,4,6 --kernels liger --flavor qwen3-4B
              run --mode reference --ac full --batches 16,32 --kernels liger --flavor qwen3-4B
              run --mode reference --ac none --batches 1,2,3,4 --kernels liger --flavor qwen3-8B
              run --mode reference --ac full --batches 16 --kernels liger --flavor qwen3-8B ;;
    ref8b) run --mode reference --ac none --batches 1,2,3 --kernels torch --flavor qwen3-8B
           run --mode reference --ac full --batches 16 --kernels torch --flavor qwen3-8B
           run --mode reference --ac none --batches 1,2,3,4,6 --kernels liger --flavor qwen3-8B
           run --mode reference --ac full --batches 16 --kernels liger --flavor qwen3-8B ;;
    fsdp4b) run --mode fsdp2 --ac none --batches 2,3 --kernels torch --flavor qwen3-4B
            run --mode fsdp2 --ac full --batches 16 --kernels torch --flavor qwen3-4B
            run --mode fsdp2 --ac none --batches 2,3,4,5 --kernels liger --flavor qwen3-4B
            run --mode fsdp2 --ac full --batches 16,32 --kernels liger --flavor qwen3-4B ;;
    slidedp4b) timeout 200 "${bench[@]}" --mode slidedp --kernels torch --flavor qwen3-4B --max-norm 0 \
                 --no-memory-check --points recompute:16 selective:16 keep:1,2,4
               timeout 300 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 0 \
                 --no-memory-check --points recompute:16,32 selective:16 keep:1,2,4,6 ;;
    # One lease, side by side: FSDP2 and SlideDP at their best settings on both kernel paths, and
    # the references they are compared with (the stages above measured the wider sweeps).
    same4b) run --mode reference --ac none --batches 2 --kernels torch --flavor qwen3-4B
            run --mode reference --ac none --batches 4 --kernels liger --flavor qwen3-4B
            run --mode reference --ac full --batches 16 --kernels torch --flavor qwen3-4B
            run --mode reference --ac full --batches 16 --kernels liger --flavor qwen3-4B
            run --mode fsdp2 --ac none --batches 2,3 --kernels torch --flavor qwen3-4B
            run --mode fsdp2 --ac full --batches 16 --kernels torch --flavor qwen3-4B
            run --mode fsdp2 --ac none --batches 2,3,4,5 --kernels liger --flavor qwen3-4B
            run --mode fsdp2 --ac full --batches 16 --kernels liger --flavor qwen3-4B
            timeout 150 "${bench[@]}" --mode slidedp --kernels torch --flavor qwen3-4B --max-norm 0 \
              --no-memory-check --points recompute:16 selective:16 keep:4
            timeout 150 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 0 \
              --no-memory-check --points recompute:16 selective:16 keep:4,6 ;;
    slidedp8b) timeout 300 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-8B --max-norm 0 \
                 --no-memory-check --points recompute:16 keep:1,2,3 ;;
    slidedp8bplain) timeout 200 "${bench[@]}" --mode slidedp --kernels torch --flavor qwen3-8B \
                      --max-norm 0 --no-memory-check --points recompute:16 ;;
    # The fused-kernels targets were set by HF + liger in another lease: measure it beside ours.
    hf) hf=(python3 -m recipes.bench.hf_reference --liger --out "$out/runs.jsonl")
        "${hf[@]}" --flavor qwen3-4B --batches 4
        run --mode reference --ac none --batches 4 --kernels liger --flavor qwen3-4B
        "${hf[@]}" --flavor qwen3-8B --batches 3
        run --mode reference --ac none --batches 3 --kernels liger --flavor qwen3-8B ;;
    # Elastic Checkpointing on one H200, one lease: the references, FSDP2's peak over its
    # checkpointing options, and SlideDP's hand-picked policies from 4 to 32 sequences (a kept
    # sequence of Qwen3-4B is 14.5 GiB on the fused kernels: past 7, part of it is offloaded or
    # some blocks replay). Each SlideDP build may run out of memory at its last point.
    policies4b)
      run --mode reference --ac none --batches 4,6,8 --kernels liger --flavor qwen3-4B
      run --mode reference --ac full --batches 16 --kernels liger --flavor qwen3-4B
      run --mode fsdp2 --ac none --batches 3,4,5 --kernels liger --flavor qwen3-4B
      run --mode fsdp2 --ac selective --batches 4,8 --kernels liger --flavor qwen3-4B
      run --mode fsdp2 --ac full --batches 16 --kernels liger --flavor qwen3-4B ;;
    policies4bmore)  # the rest of FSDP2's batches (selective's largest that fit come last)
      run --mode fsdp2 --ac none --batches 1,2 --kernels liger --flavor qwen3-4B
      run --mode fsdp2 --ac full --batches 32 --kernels liger --flavor qwen3-4B
      run --mode fsdp2 --ac selective --batches 12,16 --kernels liger --flavor qwen3-4B ;;
    policies4bslidedp)
      sd=(timeout 170 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 0)
      "${sd[@]}" --points keep:1,6 keep@offload=0.1:8 keep@offload=0.3:10
      "${sd[@]}" --points selective:16,32 recompute:32 "segments(qkv+attention_core+o_proj+mlp_up+down_proj):8"
      "${sd[@]}" --activation-blocks "0-15:keep" --label keep0-15 --points recompute:16 selective:16 ;;
    long4b) long_context qwen3-4B ;;
    long8b) long_context qwen3-8B ;;
    # Qwen3-8B with clipping at the default max_norm 1.0 (no accumulation) on the one-H200
    # machine (128 GiB of RAM): the host state is 14 B/param, 106.8 GiB, where an FP32 gradient
    # buffer made it 18 (137 GiB); with the shadow (also 14 without it, which doubles the H2D
    # bytes). The start-up check is on (no --no-memory-check): the "[slidedp] host state" line
    # prints the B/param and MemAvailable, each row has host_state_bytes_per_param and
    # peak_rss_gib. 16 sequences, the first 9 blocks keep (8.4 GiB each on the fused kernels),
    # the others recompute, then selective (about 108 and 121 GiB allocated, by the measured
    # bytes per token).
    # Qwen3-8B with clipping: the best hand-picked mix of call 6 and an MLP-input mask over most
    # blocks (the step-time model's pick), each with the CPU Adam on every core and on 12 of the
    # 16 (the compute and delivery threads then keep cores of their own while updates run).
    threads8b) timeout "${THREADS_SECONDS:-240}" "${bench[@]}" --mode slidedp --kernels liger \
                 --flavor qwen3-8B --max-norm 1.0 --points "selective|0-8:keep:16" \
                 "segments(mlp_up)|28-35:selective:16" --cpu-threads 0,12 --label clip1 ;;
    clip8b) timeout 300 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-8B --max-norm 1.0 \
              --activation-blocks "0-8:keep" --points recompute:16 selective:16 \
              "segments(qkv+attention_core+o_proj+mlp_up+down_proj):5,6" --label clip1-keep0-8 ;;
    # The small-batch tail: Qwen3-4B, keep, 1 and 2 sequences, no clipping, each point in both
    # update orders in one build. "arrival" runs the host updates as the gradients came home, so
    # the embedding's, which the next forward needs first, runs last (the order before
    # slidedp.update_order); "next_use" runs what backward left embedding first, so the next
    # forward overlaps it. Rows: update_order, step_time_s, update_tail_s (end of a step's compute
    # to its last update), update_wait_s, host_delivery_wait_s (the forward's waits for
    # deliveries, version gates included).
    tail4b) timeout 240 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 0 \
              --no-memory-check --points keep:1,2 "segments(qkv+attention_core+o_proj+mlp_up+down_proj):8" \
              --update-order arrival,next_use --steps 3 --label tail ;;
    # The embedding's update on the GPU (slidedp.embedding_update, slidedp/gpu_update.py) against
    # the host's, each point under both in one build, in one lease with FSDP2's peak and the
    # no-recompute reference of Qwen3-4B at 8 sequences (call 8's best points, no clipping): the
    # issue-10 targets, 1.10x FSDP2 and 0.95x the reference. SlideDP: AutoPolicy's call-8 pick
    # (keep, 34-35 recompute, 2 slots), and keep everywhere with half of blocks 0-3 offloaded
    # instead of the two replays. Then Qwen3-8B with clipping at 16: AutoPolicy's call-14 pick,
    # where the embedding's 622M-parameter update is the first the next forward waits for.
    embed)
      python3 -m pytest -q -x tests/test_slidedp.py -k one_gpu_embedding
      timeout 200 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 0 \
        --no-memory-check --slots 2 --embedding-update host,gpu \
        --points "keep|34-35:recompute:8" "keep|0-3:keep@offload=0.5:8"
      timeout 90 "${bench[@]}" --mode fsdp2 --ac selective --batches 8 --kernels liger --flavor qwen3-4B --max-norm 0
      timeout 80 "${bench[@]}" --mode reference --ac none --batches 8 --kernels liger --flavor qwen3-4B --max-norm 0
      timeout 230 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-8B --max-norm 1.0 \
        --no-memory-check --slots 2 --embedding-update host,gpu \
        --points "recompute|0-9:keep, 28-35:selective:16" ;;
    # FSDP2 with torchtitan's op-level selective checkpointing, and with CPUOffloadPolicy (the
    # sharded FP32 state in host memory, AdamW on the CPU after backward: 8B fits one H200 then).
    sac4b) run --mode fsdp2 --ac selective --batches 2,4,8 --kernels liger --flavor qwen3-4B ;;
    offload4b) run --mode fsdp2 --fsdp-cpu-offload --ac full --batches 4,16 --kernels liger --flavor qwen3-4B ;;
    offload8b) run --mode fsdp2 --fsdp-cpu-offload --ac full --batches 4,16 --kernels liger --flavor qwen3-8B ;;
    # DeepSpeed ZeRO-Offload (recipes/baselines/zero_offload.py). The GPU machine has no network:
    # carry the wheels in DS_WHEELS (made outside the repository: pip wheel deepspeed==0.19.8 -w DIR gives
    # deepspeed-0.19.8-py3-none-any.whl, 2.2 MB, with hjson and pydantic's wheels where the GPU image lacks
    # them). They go in without dependency resolution into DS_TARGET, put on PYTHONPATH for the later
    # stages (with resolution, call 12's install failed: no einops in the wheel folder, and the
    # image's was not taken). The first engine JIT-compiles DeepSpeedCPUAdam with ninja and the host compiler (cached in
    # ~/.cache/torch_extensions).
    dsinstall) python3 -m pip install -q --no-index --no-deps --no-compile --target "${DS_TARGET:=/tmp/ds-site}" \
                 "${DS_WHEELS:?set DS_WHEELS to the wheel folder}"/*.whl || exit 1
               export PYTHONPATH="$DS_TARGET:$PYTHONPATH"
               python3 -c 'import deepspeed; print("deepspeed", deepspeed.__version__)' || exit 1 ;;
    # The issue's target: SlideDP >= 2.0x ZeRO-Offload as a geometric mean over 1..16 sequences
    # (reproduce-head_to_head measures both sides in one go).
    zero4b) run --mode deepspeed --zero-stage 2 --ac full --batches 1,2,4,8,16 --kernels liger --flavor qwen3-4B
            timeout 300 "${bench[@]}" --mode deepspeed --zero-stage 2 --ac none --batches 1,2,4 --kernels liger \
              --flavor qwen3-4B
            run --mode deepspeed --zero-stage 3 --ac full --batches 4,16 --kernels liger --flavor qwen3-4B ;;
    zero8b) run --mode deepspeed --zero-stage 2 --ac full --batches 4,16 --kernels liger --flavor qwen3-8B ;;
    # The matched-batch head-to-head again (Qwen3-4B, clipping at 1.0), in one lease: ZeRO-2
    # Offload at its best setting per batch in calls 12-13 (full AC at 1, 8, 16; none at 2, 4)
    # first, then SlideDP at its best per batch in call 17: `keep` with the host's embedding
    # update at 1-2, the GPU's at 4-8, the keep/selective mix at 16. DeepSpeed's first launch
    # JIT-builds its CPU Adam (call 17's 150 and 90 s limits ended both launches before a row;
    # call 13's 300 s each were enough; in call 18 the two launches took 136 and 98 s to build,
    # and 120 s ended the no-AC one). Each launch's limit is cut to what is left of H2H_SECONDS:
    # the limits add up to more than one call, so what is cut goes to the next call of the lease
    # (call 20 ran the no-AC launch and the mix). Rows are labelled with recipes/reproduce's
    # system names, so `head_to_head --rows` makes the table from them. Needs dsinstall first.
    h2h) stage_end=$(( SECONDS + ${H2H_SECONDS:-570} ))
         within 270 "${bench[@]}" "${H2H[@]}" --mode deepspeed --zero-stage 2 --ac full --batches 1,8,16 \
           --label zero2-offload
         within 170 "${bench[@]}" "${H2H[@]}" --mode deepspeed --zero-stage 2 --ac none --batches 2,4 \
           --label zero2-offload-noac
         within 80 "${bench[@]}" "${H2H[@]}" --mode slidedp --activation keep --batches 1,2 --label slidedp-keep
         within 90 "${bench[@]}" "${H2H[@]}" --mode slidedp --activation keep --batches 4,8 \
           --embedding-update gpu --label slidedp-keep-gpuembed
         within 80 "${bench[@]}" "${H2H[@]}" --mode slidedp --activation selective --keep-blocks 14 \
           --batches 16 --embedding-update gpu --label slidedp-selective-keep14-gpuembed ;;
    # mix16: splits what the keep/selective mix at 16 sequences (blocks 0-13 kept) gains over
    # `selective` everywhere between the kept blocks and the embedding update. Both policies under
    # both embedding updates in one build, each with one profiled step whose per-stream breakdown
    # lands in its row (the traces stay on the machine).
    # shellcheck disable=SC2086  # BENCH_FLAGS: a CPU check, as for issue 14's stages
    mix16) timeout 300 "${bench[@]}" --mode slidedp --kernels liger --flavor qwen3-4B --max-norm 1.0 \
             --no-memory-check --embedding-update host,gpu --points selective:16 \
             "selective|0-13:keep:16" --trace-dir /tmp/traces --trace-batch 16 ${BENCH_FLAGS:-} ;;
    plan) plan_stage ;;
    paper1|paper2|paper3|peers|peers2|offload|offload2) "$stage" ;;
    multi8b|multi14b|strong14b|weak32b|million|castcopy) "$stage" ;;
    routes14b) routes 4 8,16 200 ;;
    remeasure4b|fsdp2peak4b|remeasure8b) "$stage" ;;
    routes14b8) routes 8 64 330 --steps 1 ;;
    # The predictions (PLAN_PREDICTED) beside this call's rows, and every row against the
    # reference and FSDP2's peak.
    compare) python3 -m recipes.bench.model_check compare "${PLAN_PREDICTED:?the predictions file}" \
               "$out/runs.jsonl"
             python3 -m recipes.bench.throughput --report "$out/runs.jsonl" ;;
    # One script with no time limit of its own (REPRODUCE_ARGS, PAPER_DIR and PAPER_TAR as for
    # `paper` above).
    reproduce-*) stage_end=$(( SECONDS + 86400 ))
                 paper 86400 "${stage#reproduce-}" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
