#!/bin/bash
# One device call of this session: the plan follows the card that came (H200: issue 25 item 5 over
# 1-16; H100: its 1-2 sequence half with the host stream bench). $1 is the call's number in this
# machine start; the first runs the wide correctness stage and installs DeepSpeed.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session37
sel=base
[ "$1" = 1 ] && sel="base or resident or embedding-gpu or keep"
case "$gpu" in
  *H200*) suites="head_to_head slidedp_best"
          [ "$1" = 1 ] && sel="base or resident or embedding-gpu or selective or keep or next-use or gpu+blocks" ;;
  *) suites="docs/results/2026-12-07-session36/h2h_h100_1to2.toml"
     [ "$1" = 1 ] && suites="$suites $here/stream.toml" ;;
esac
suites="deepspeed_install $suites"
python -m recipes.bench.suite "$OUT/s" $suites --set ds_wheels=.whl-ds --set launches=1 --set correctness.select="$sel"
