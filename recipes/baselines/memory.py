"""Device bytes of one rank of the baselines (single, fsdp2, deepspeed): what each holds on the
device besides activations, and what its activation checkpointing keeps per block. The
activations and logits are modelled once, for every mode, in slidedp/plan/memory.py.

resident and gradients, by mode (N = parameters, R = ranks, b = bytes of the compute dtype: 2
for BF16, 4 for FP32):
    single    resident: FP32 weights + Adam m and v, 12 B/param, plus the BF16 weight copies
              that autocast caches during the step (2 B/param with training.dtype = "bf16");
              gradients: FP32, 4 B/param
    fsdp2     resident: the same 12 B/param sharded over R, plus unsharded copies in the
              compute dtype of the root (embedding, final norm, head) and of
              FSDP_UNSHARDED_BLOCKS blocks; gradients: 4 B/param sharded over R, plus the
              unsharded gradient of the root and of one block in the compute dtype and in FP32
              for the reduce-scatter; with parallelism.fsdp_cpu_offload the sharded 12 + 4
              B/param are in host memory
    deepspeed ZeRO-Offload (the optimizer state and FP32 master on the host): resident BF16
              weights, 2 B/param (ZeRO-2: all of them; ZeRO-3: sharded over R plus the root and
              FSDP_UNSHARDED_BLOCKS blocks gathered); gradients: BF16, 2 B/param (ZeRO-2's
              reduce buckets hold them until they are copied to the host) or sharded over R
              (ZeRO-3)
"""

import math

from protocols.model_spec import ModelArgs, spec_of
from recipes.config import JobConfig, run_config
from slidedp.activations import KEEP, RECOMPUTE, ActivationPolicy
from slidedp.plan.memory import CachedOutputs, Footprint
from slidedp.plan.predict import compute_dtype

FSDP_UNSHARDED_BLOCKS = 3
"""fsdp2, ZeRO-3: blocks unsharded at once (the one computing, the prefetched one, the last
block, which stays unsharded after forward)."""

def _checkpointing(mode: str, args: ModelArgs) -> ActivationPolicy | CachedOutputs:
    """What each block keeps under activation_checkpoint.mode; "selective" is torchtitan's
    op-level policy (recipes/baselines/activation_checkpoint.py): every other matmul's output
    (for Qwen q, v, gate, down) and SDPA's."""
    if mode == "selective":
        outputs = spec_of(args).saved.op_outputs
        return CachedOutputs(frozenset(outputs["matmul"][::2] + outputs["attention"]))
    return {"none": KEEP, "full": RECOMPUTE}[mode]


def baseline_footprint(config: JobConfig, args: ModelArgs, *, world: int) -> Footprint:
    """The resident bytes and gradients of `config`'s mode (module docstring), its blocks'
    checkpointing, and its compute dtype (DeepSpeed always computes in BF16)."""
    mode, n = config.parallelism.mode, args.num_params()
    b = 2 if compute_dtype(run_config(config)) == "bf16" else 4
    policies = [_checkpointing(config.activation_checkpoint.mode, args)] * args.n_layers
    block = args.block_params()
    root = n - args.n_layers * block
    if mode == "single":
        resident, gradients = n * 12 + (n * 2 if b == 2 else 0), n * 4
    elif mode == "fsdp2":
        on_device = not config.parallelism.fsdp_cpu_offload  # else the shards are on the host
        resident = (on_device * math.ceil(n * 12 / world)
                    + (root + FSDP_UNSHARDED_BLOCKS * block) * b)
        gradients = on_device * math.ceil(n * 4 / world) + (root + block) * (b + 4)
    elif mode == "deepspeed" and config.deepspeed.zero_stage == 2:
        resident, gradients = n * 2, n * 2
    elif mode == "deepspeed":
        gathered = (root + FSDP_UNSHARDED_BLOCKS * block) * 2
        resident = math.ceil(n * 2 / world) + gathered
        gradients = math.ceil(n * 2 / world) + block * 2
    else:
        raise ValueError(f"no baseline footprint for parallelism.mode = {mode!r}")
    return Footprint(resident=resident, gradients=gradients, policies=policies, compute_bytes=b)
