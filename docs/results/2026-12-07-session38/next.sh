#!/bin/bash
# A device call of the next start: $1 is the call's number in that machine start (the first runs
# the wide correctness stage). On an H200: issue 25 item 5's head-to-head over 1-16 against
# ZeRO-2 Offload. On an H100, where that head-to-head meets the rules (sessions 36 and 38): the
# withdrawn FSDP2 + CPUOffload ratio, then (a later start) ZeRO-3's, each against SlideDP's best
# per batch in the same calls.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session38
sel=base
case "$gpu" in
  *H200*) suites="head_to_head slidedp_best"
          [ "$1" = 1 ] && sel="base or resident or embedding-gpu or selective or keep or next-use or gpu+blocks" ;;
  *) suites="$here/${PEER:-h100_fsdp2_offload}.toml $here/h100_slidedp_best.toml"
     [ "$1" = 1 ] && sel="base or resident or embedding-gpu or selective or keep" ;;
esac
# DeepSpeed does not survive between calls: install it in every one.
python -m recipes.bench.suite "$OUT/s" deepspeed_install $suites --set ds_wheels=.whl-ds --set launches=1 --set correctness.select="$sel"
