#!/bin/bash
# A device call of the next start: $1 is the call's number in that machine start (the first runs
# the correctness stage of every option measured). On an H200: issue 25 item 5's head-to-head over
# 1-16 against ZeRO-2 Offload. On an H100: the withdrawn ZeRO-3 Offload ratio, SlideDP's best per
# batch first, then ZeRO-3 with and without checkpointing, in each call.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
sel=base
case "$gpu" in
  *H200*) suites="head_to_head slidedp_best"
          [ "$1" = 1 ] && sel="base or resident or embedding-gpu or selective or keep or next-use or gpu+blocks" ;;
  # Call 1 checks only the options the H100 suites measure: the wider stage would not leave
  # the call's 600 s for both sides.
  *) suites="docs/results/2026-12-07-session38/h100_slidedp_best.toml docs/results/2026-12-07-session39/h100_zero3_offload.toml"
     [ "$1" = 1 ] && sel="base or (all-resident and not bf16) or (embedding-gpu and not clipping) or keep or selective" ;;
esac
# DeepSpeed does not survive between calls: install it in every one.
python -m recipes.bench.suite "$OUT/s" deepspeed_install $suites --set ds_wheels=.whl-ds --set launches=1 --set correctness.select="$sel"
