#!/bin/bash
# A device call of the next start: $1 is the call's number in that machine start (the first runs
# the correctness stage of every option measured). On an H200: issue 25 item 5's head-to-head over
# 1-16 against ZeRO-2 Offload. On an H100, PLAN=state (the default): SlideDP's settings with part
# of the optimizer state resident, beside its best measured ones, in each call; PLAN=zero3: the
# withdrawn ZeRO-3 Offload ratio, SlideDP's best per batch first, then ZeRO-3 with and without
# checkpointing.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 ${PLAN:-state} $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session39
best=docs/results/2026-12-07-session38/h100_slidedp_best.toml
sel=base
case "$gpu" in
  *H200*) suites="deepspeed_install head_to_head slidedp_best"
          [ "$1" = 1 ] && sel="base or resident or embedding-gpu or selective or keep or next-use or gpu+blocks" ;;
  # Call 1 checks only the options the H100 suites measure: the wider stage would not leave
  # the call's 600 s for both sides.
  *) case "${PLAN:-state}" in
       state) suites="$best $here/h100_slidedp_state.toml" ;;
       zero3) suites="deepspeed_install $best $here/h100_zero3_offload.toml" ;;
     esac
     [ "$1" = 1 ] && sel="base or (all-resident and not bf16) or (embedding-gpu and not clipping) or keep or selective" ;;
esac
# DeepSpeed does not survive between calls: a plan with a DeepSpeed peer installs it in every one.
python -m recipes.bench.suite "$OUT/s" $suites --set ds_wheels=.whl-ds --set launches=1 --set correctness.select="$sel"
