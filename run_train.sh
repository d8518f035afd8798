#!/usr/bin/env bash
# Launch training (torchtitan style). Any TOML key can be overridden: --section.key=value.
#
#   ./run_train.sh                                         # train_configs/debug_cpu.toml, 1 process
#   NGPU=2 ./run_train.sh                                  # 2 ranks (mode "single" becomes fsdp2)
#   NGPU=2 ./run_train.sh --parallelism.mode=slidedp       # 2 ranks (NCCL on GPUs, gloo on CPU)
#   CONFIG_FILE=train_configs/h200_qwen3_8b.toml NGPU=2 ./run_train.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 ./run_train.sh  # on node 0,
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 ./run_train.sh  # on node 1
#   (or RDZV_ENDPOINT=host:port instead of NODE_RANK/MASTER_ADDR/MASTER_PORT: c10d rendezvous)
# Run it from the repository root (config paths are relative to it). With NGPU >= 2 the whole
# configuration (data records included) is checked once before any rank starts, and the ranks'
# end is said as one process's would be: a mistake is one `error:` line and exit code 2, Ctrl-C
# one line and exit code 130 (recipes/launch.py).
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_cpu.toml}
NGPU=${NGPU:-1}
PYTHON=${PYTHON:-python3}

if ! [[ "$NGPU" =~ ^[0-9]+$ ]] || (( 10#$NGPU < 1 )); then
  echo "error: NGPU must be the number of ranks to start (1 or more), got '$NGPU'" >&2
  exit 2
fi
NGPU=$(( 10#$NGPU ))
NNODES=${NNODES:-1}
if ! [[ "$NNODES" =~ ^[0-9]+$ ]] || (( 10#$NNODES < 1 )); then
  echo "error: NNODES must be the number of nodes (1 or more), got '$NNODES'" >&2
  exit 2
fi
export NNODES=$(( 10#$NNODES ))  # recipes/launch.py reads it, with NODE_RANK, MASTER_ADDR, ...

# NVLink multicast (NVLS) stays off in NCCL, torch symmetric memory and NVSHMEM: on the shared
# H200 hosts a program that uses it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The caching allocator grows segments in place instead of leaving fragments. Long sequences run
# near the card's limit (262,144 tokens of Qwen3-8B: 121 GiB allocated at peak on one H200), and
# torchtitan's run_train.sh sets the same default.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# torchrun forces OMP_NUM_THREADS=1 when it is unset; CPU-side work (the SlideDP optimizer, CPU
# runs) wants this rank's share of the cores instead.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  OMP_NUM_THREADS=$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))
  export OMP_NUM_THREADS
fi

for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then NGPU=1 NNODES=1; fi  # help: one process prints it
done
if (( NGPU == 1 && NNODES == 1 )); then
  exec "$PYTHON" -m recipes.train --job.config_file "$CONFIG_FILE" "$@"
fi
# The checks, then torchrun (one node, or this node of NNODES) in the same process (so that
# the ranks run this Python too).
exec "$PYTHON" -m recipes.launch "$NGPU" --job.config_file "$CONFIG_FILE" "$@"
