#!/bin/bash
# A device call of a machine start ($1: the call's number in that start); moved here from session
# 39's folder, with plans sized for a start that has about 1,250 s left. Every call first checks
# each SlideDP option it measures against `single` on the GPU (docs/PERFORMANCE.md rule 2).
# LAUNCHES (default 1): launches of each setting in this call; a start of two calls runs 2, then 1;
# a start of one call runs 3 on an H100, and the suite's deadline leaves out what does not fit.
# PLAN=small (the default; three calls take about 1,200 s, or two with LAUNCHES=2 in the first):
#   H200: issue 25 item 5 at 1-4 sequences against ZeRO-2 Offload (h200_small.toml);
#   H100: the model's 2-sequence choice before and after the h100 rates held the host's launch
#   times, 3 launches a side (docs/results/2026-12-08-h100-session43/h100_launches_2.toml);
#   LAUNCHES=3 in one call (about 420 s).
# PLAN=full (three calls take about 1,650 s):
#   H200: the head-to-head over 1-16 against ZeRO-2 Offload;
#   H100: the measured best against the model's settings over 2-16.
# PLAN=zero3 (H100, about 900 s in two calls: LAUNCHES=2, then 1): ZeRO-3 Offload's peak (full
#   checkpointing at 16 sequences) against the model's setting at 16, 3 launches a side (session
#   43 ran the 1-16 sweep twice a side; three do not fit one session's device time).
# PLAN=issue28 (H200, about 1,400 s in three calls): issue 28's Qwen3-4B ratios at clipping 1.0 in
#   one start: call 1 FSDP2's peak (fsdp2_peak_4b) and the no-recompute reference (reference_4b),
#   3 launches each; calls 2 and 3 (LAUNCHES=2, then 1) SlideDP's measured best and the step-time
#   model's best (docs/results/2026-12-08-cpu-session44/h200_issue28_4b.toml).
# PLAN=probe (either card, about 300 s): the probe's rates of this host for Qwen3-4B, blocks timed
#   at 8 sequences since session 43, with the host's launch (issue) times (the h100 rates hold an
#   H100 host's since session 43, the h200 rates none); it measures no figure. Then
#   `model_check check --rates OUT/rates_4b.json` on sessions 41-43's H100 rows.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
plan=${PLAN:-small}
echo "$gpu call $1 $plan $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session40
resident="(real_size and resident)"
if [ "$plan" = probe ]; then  # the model's 2-sequence setting's policy among those timed
  SLIDEDP_RATES_DIR="$OUT/rates" timeout 540 python -m recipes.probe train_configs/h200_qwen3_4b_slidedp.toml \
    --training.local_batch_size 2 --slidedp.activation 'ops(matmul+attention)' --out "$OUT/rates_4b.json"
  exit
fi
case "$gpu $plan" in
  *H200*small) suites="deepspeed_install $here/h200_small.toml"; LAUNCHES=1  # two do not fit a call
               options="(all-resident and not bf16) or $resident" ;;
  *H200*issue28) if [ "$1" = 1 ]; then suites="fsdp2_peak_4b reference_4b"
                 else suites="docs/results/2026-12-08-cpu-session44/h200_issue28_4b.toml"; fi
                 options="(all-resident and not bf16) or ops or offload or $resident" ;;
  *H200*full) suites="deepspeed_install head_to_head slidedp_best"
              options="(all-resident and not bf16) or keep or selective or ops or offload" ;;
  *small) suites="docs/results/2026-12-08-h100-session43/h100_launches_2.toml"
          options="offload or segments or ops or $resident" ;;
  *full) suites="docs/results/2026-12-07-session39/h100_slidedp_planned.toml"
         options="keep or selective or offload or segments or ops" ;;
  *zero3) suites="deepspeed_install docs/results/2026-12-08-h100-session43/h100_zero3_peak.toml"
          options="selective or offload or segments or $resident" ;;
  *) echo "no plan $plan for $gpu" >&2; exit 2 ;;
esac
# DeepSpeed does not survive between calls: a plan with a DeepSpeed peer installs it in every one.
python -m recipes.bench.suite "$OUT/s" $suites --set ds_wheels=.whl-ds --set launches=${LAUNCHES:-1} \
  --set correctness.select="base or (embedding-gpu and not clipping) or $options"
