#!/usr/bin/env bash
# Launch training (torchtitan style). Any TOML key can be overridden: --section.key=value.
#
#   ./run_train.sh                                         # train_configs/debug_cpu.toml, 1 process
#   NGPU=2 ./run_train.sh --parallelism.mode=fsdp2         # 2 ranks (NCCL on GPUs, gloo on CPU)
#   CONFIG_FILE=train_configs/h200_qwen3_8b.toml NGPU=2 ./run_train.sh
set -euo pipefail

cd "$(dirname "$0")"
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_cpu.toml}
NGPU=${NGPU:-1}

# NVLink SHARP / multicast objects are not available on the lent machines; keep NCCL and
# symmetric memory on plain NVLink paths.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# torchrun forces OMP_NUM_THREADS=1 when it is unset; CPU-side work (the SlideDP optimizer, CPU
# runs) wants this rank's share of the cores instead.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  OMP_NUM_THREADS=$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

if [[ "$NGPU" -eq 1 ]]; then
  exec python -m recipes.train --job.config_file "$CONFIG_FILE" "$@"
fi
exec torchrun --standalone --nproc_per_node="$NGPU" -m recipes.train --job.config_file "$CONFIG_FILE" "$@"
