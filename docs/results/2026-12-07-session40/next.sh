#!/bin/bash
# A device call of session 40's start ($1: the call's number in that start), sized so that three
# calls fit the device time left after two failed starts. Every call first checks each SlideDP
# option it measures against `single` on the GPU (docs/PERFORMANCE.md rule 2). On an H200: issue
# 25 item 5 at 1-4 sequences against ZeRO-2 Offload (h200_small.toml). On an H100: SlideDP's
# measured best at 2 and 4 beside the step-time model's settings (h100_planned_2to4.toml).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu call $1 $(date -u +%FT%TZ)" >> "$OUT/calls.txt"
here=docs/results/2026-12-07-session40
case "$gpu" in
  *H200*) suites="deepspeed_install $here/h200_small.toml"
          options="(all-resident and not bf16) or (real_size and resident)" ;;
  *) suites="$here/h100_planned_2to4.toml"
     options="keep or offload or segments or ops or (real_size and resident)" ;;
esac
# DeepSpeed does not survive between calls: a plan with a DeepSpeed peer installs it in every one.
python -m recipes.bench.suite "$OUT/s" $suites --set ds_wheels=.whl-ds --set launches=1 \
  --set correctness.select="base or (embedding-gpu and not clipping) or $options"
