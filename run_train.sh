#!/usr/bin/env bash
# Launch training (torchtitan style). Any TOML key can be overridden: --section.key=value.
#
#   ./run_train.sh                                         # train_configs/debug_cpu.toml, 1 process
#   NGPU=2 ./run_train.sh --parallelism.mode=fsdp2         # 2 ranks (NCCL on GPUs, gloo on CPU)
#   CONFIG_FILE=train_configs/h200_qwen3_8b.toml NGPU=2 ./run_train.sh
# Run it from the repository root (config paths are relative to it).
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_cpu.toml}
NGPU=${NGPU:-1}
PYTHON=${PYTHON:-python3}

# NVLink multicast (NVLS) stays off in NCCL, torch symmetric memory and NVSHMEM: on the shared
# H200 hosts a program that uses it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# torchrun forces OMP_NUM_THREADS=1 when it is unset; CPU-side work (the SlideDP optimizer, CPU
# runs) wants this rank's share of the cores instead.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  OMP_NUM_THREADS=$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

if [[ "$NGPU" -eq 1 ]]; then
  exec "$PYTHON" -m recipes.train --job.config_file "$CONFIG_FILE" "$@"
fi
# torchrun, through the interpreter so that it is the same Python.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  -m recipes.train --job.config_file "$CONFIG_FILE" "$@"
