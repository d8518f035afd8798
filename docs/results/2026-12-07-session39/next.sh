#!/bin/bash
# A device call of the next start ($1: the call's number in that machine start). Every call first
# checks each SlideDP option it measures against `single` on the GPU (docs/PERFORMANCE.md rule 2).
# On an H200: issue 25 item 5's head-to-head over 1-16 against ZeRO-2 Offload. On an H100,
# PLAN=planned (the default): SlideDP's measured best beside the step-time model's settings;
# PLAN=zero3: the withdrawn ZeRO-3 Offload ratio, SlideDP's best per batch first, then ZeRO-3.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 ${PLAN:-planned} $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session39
case "$gpu" in
  *H200*) suites="deepspeed_install head_to_head slidedp_best"
          options="(all-resident and not bf16) or keep or selective or ops or offload" ;;
  *) case "${PLAN:-planned}" in
       planned) suites="$here/h100_slidedp_planned.toml"
                options="keep or selective or offload or segments or ops" ;;
       zero3) suites="deepspeed_install docs/results/2026-12-07-session38/h100_slidedp_best.toml $here/h100_zero3_offload.toml"
              options="keep or selective or (all-resident and not bf16)" ;;
     esac ;;
esac
# DeepSpeed does not survive between calls: a plan with a DeepSpeed peer installs it in every one.
python -m recipes.bench.suite "$OUT/s" $suites --set ds_wheels=.whl-ds --set launches=1 \
  --set correctness.select="base or (embedding-gpu and not clipping) or $options"
