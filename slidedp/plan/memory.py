"""Device bytes one rank needs, estimated from the model's shapes before anything is allocated.

The start-up check (recipes/preflight.py) refuses a run whose estimate clearly exceeds the
device (REFUSE_ABOVE), so the estimate only has to be right to within tens of percent; it is
not a substitute for measuring peak memory.

    total = resident + max(gradients, activations + logits)

Activations peak when backward starts and are freed block by block as the gradients fill in
(the GPU-resident modes drop their gradients between steps), so the two never peak together.

resident and gradients, by mode (N = parameters, R = ranks, b = bytes of the compute dtype: 2
for BF16, 4 for FP32):
    single   resident: FP32 weights + Adam m and v, 12 B/param, plus the BF16 weight copies that
             autocast caches during the step (2 B/param with training.dtype = "bf16");
             gradients: FP32, 4 B/param
    fsdp2    resident: the same 12 B/param sharded over R, plus unsharded copies in the compute
             dtype of the root (embedding, final norm, head) and of FSDP_UNSHARDED_BLOCKS blocks;
             gradients: 4 B/param sharded over R, plus the unsharded gradient of the root and of
             one block in the compute dtype and in FP32 for the reduce-scatter; with
             parallelism.fsdp_cpu_offload the sharded 12 + 4 B/param are in host memory
    deepspeed ZeRO-Offload (the optimizer state and FP32 master on the host): resident BF16
             weights, 2 B/param (ZeRO-2: all of them; ZeRO-3: sharded over R plus the root and
             FSDP_UNSHARDED_BLOCKS blocks gathered); gradients: BF16, 2 B/param (ZeRO-2's
             reduce buckets hold them until they are copied to the host) or sharded over R
             (ZeRO-3)
    slidedp  resident: BF16 buffers (slidedp.window_slots block slots + embedding + head), the
             gradients in flight during backward (SLIDEDP_GRAD_COPIES copies of
             SLIDEDP_GRAD_BLOCKS blocks and of the head; the embedding's comes last, when the
             activations are gone), the reduce-scatter receive buffer (largest unit / R) and,
             without slidedp.bf16_shadow, the FP32 chunk that delivery casts on the device;
             gradients: 0 (they go to the host as they come), except where the reduced shards
             wait on the device for their updates (no shadow, no clipping, guard off, one
             micro-batch, gpu route: slidedp.host_state.HostStatePlan.hold), one step's: 2/R
             B/param

activations: tokens per micro-batch (local_batch_size x seq_len) x (the sum over blocks of the
bytes per token of each block's policy + the one block a recompute policy rebuilds in backward +
STREAM_TERMS for the embedding output, the final norm and the gradient flowing back). Bytes per
token of one block = sum over the model's widths of width x (FP32 copies x 4 + compute-dtype
copies x b), with the copies per policy in ACTIVATION_TERMS (derived below from what autograd
saves in models/qwen.py) for keep, recompute and selective; a policy's offload fraction leaves
that part of what the hooks save on the host (all of keep and recompute, selective's block
input). Other segment masks and op sets count as recompute, a lower bound: SlideDP measures
every policy on the device at start (slidedp/activations/cost.py) and prints it. Widths: dim; q = n_heads x head_dim; kv = n_kv_heads x head_dim;
qk_norm = q + kv when the model norms queries and keys (else 0); hidden = the MLP's width;
heads = n_heads.

logits: one chunk of the loss, min(loss_chunk_tokens, tokens) x vocab x LOGITS_BYTES.

Every constant that calibration may change is in the block below. They are counted from the
code (LOGITS_BYTES and the embedding's gradient were revised after comparing with the peaks
measured on 2 x H200, docs/PERFORMANCE.md): for Qwen3-8B and 14B under fsdp2 and slidedp the
estimate is 0-15% above the measured allocation
(tests/test_preflight.py::test_estimate_is_near_the_measured_peak); for Qwen3-4B on one H200 on
both kernel paths, -3% to +22% (the most for full recompute;
test_estimate_is_near_the_measured_peak_on_both_kernel_paths). Not measured: mode single,
whose autocast keeps the residual stream in FP32 (its activations count as the compute dtype's).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from models.args import QwenArgs
from slidedp.activations import KEEP, RECOMPUTE, ActivationPolicy, block_policies
from slidedp.host_state import HostStatePlan, updates_deferred
from slidedp.layout import StateLayout, chunk_elems
from slidedp.peer_styles import RUNTIME_STYLES

Kernel = Literal["liger", "torch"]
"""What models/kernels.py resolves [model] kernels to."""

# ---- calibration constants -----------------------------------------------------------------

_SHARED_TERMS: dict[str, dict[str, tuple[int, int]]] = {
    # the block input only (non-reentrant checkpoint of the whole block)
    "recompute": {"dim": (0, 1)},
    # the block input and the attention kernel's outputs (slidedp/activations.py)
    "selective": {"dim": (0, 1), "q": (0, 1), "heads": (1, 0)},
    # activation_checkpoint.mode = "selective", torchtitan's op-level policy
    # (recipes/baselines/activation_checkpoint.py): the block input, the q, v, gate and down
    # projections (every other matmul) and the attention kernel's output and log-sum-exp
    "op_selective": {"dim": (0, 2), "q": (0, 2), "kv": (0, 1), "hidden": (0, 1),
                     "heads": (1, 0)},
}
ACTIVATION_TERMS: dict[str, dict[str, dict[str, tuple[int, int]]]] = {
    # kernels -> policy -> width -> (FP32 copies, compute-dtype copies) saved per token of one block
    "torch": {
        "keep": {
            "dim": (2, 2),      # each RMSNorm saves its FP32 input and its normalized output
            "qk_norm": (1, 1),  # the same for the per-head query / key norms (Qwen3)
            "q": (0, 3),        # the query after RoPE, the attention output, o_proj's input copy
            "kv": (0, 2),       # key after RoPE, value
            "hidden": (0, 4),   # gate and up outputs, SiLU(gate), the product (down_proj's input)
            "heads": (1, 0),    # the attention kernel's log-sum-exp
        },
        **_SHARED_TERMS,
    },
    # liger-kernel's autograd Functions (models/kernels.py); on the H200, Qwen3-4B saved
    # 110,376 B/token/block (docs/PERFORMANCE.md, 2026-12-01), these terms give 109,696.
    "liger": {
        "keep": {
            "dim": (0, 4),      # each RMSNorm's input and its output (the next matmuls' input)
            "qk_norm": (0, 1),  # the query and key before their norms (Qwen3)
            "q": (0, 2),        # the rotated query (rotated in place), the attention output
            "kv": (0, 2),       # the rotated key, the value
            "hidden": (0, 3),   # gate and up (SwiGLU recomputes SiLU), the product
            "heads": (1, 0),    # the attention kernel's log-sum-exp
        },
        **_SHARED_TERMS,
    },
}

STREAM_TERMS: dict[str, tuple[int, int]] = {"dim": (3, 2)}
"""Per token outside the blocks: the embedding output, the final norm's FP32 input and output,
and the gradient flowing back (two FP32 copies: a block's output and input gradient)."""
LOGITS_BYTES: dict[str, int] = {"torch": 12, "liger": 2}
"""Per logit of the loss chunk. torch: the chunk rebuilt in backward, its FP32 log-softmax (4), its
gradient in FP32 (4) and BF16 (2), and the BF16 logits while they are cast (2). liger: the BF16
logits, which the fused kernel overwrites with their gradient."""
HEAD_GRAD_BYTES: dict[str, int] = {"torch": 0, "liger": 6}
"""Per head parameter: the liger loss computes the head's gradient in its forward, into an FP32
accumulator (4) that is cast to BF16 (2) at the end."""

FSDP_UNSHARDED_BLOCKS = 3
"""fsdp2: blocks unsharded at once (the one computing, the prefetched one, the last block, which
stays unsharded after forward)."""
SLIDEDP_GRAD_BLOCKS = 2
"""slidedp: blocks whose gradients are on the device at once (the one in backward, the one
being returned)."""
SLIDEDP_GRAD_COPIES = 2
"""slidedp: device copies of a unit's gradient (the leaves' .grad and the flat buffer sent)."""
REFUSE_ABOVE = 1.10
"""The start-up check refuses a run whose estimate exceeds the capacity by more than this."""

# ------------------------------------------------------------------------------------------------


def _widths(args: QwenArgs) -> dict[str, int]:
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"dim": args.dim, "q": q, "kv": kv, "qk_norm": q + kv if args.qk_norm else 0,
            "hidden": args.hidden_dim, "heads": args.n_heads}


def _bytes_per_token(terms: dict[str, tuple[int, int]], args: QwenArgs, *,
                     compute_bytes: int) -> int:
    widths = _widths(args)
    return sum(widths[w] * (fp32 * 4 + copies * compute_bytes)
               for w, (fp32, copies) in terms.items())


def activation_bytes_per_token(args: QwenArgs, policy: ActivationPolicy, *, compute_bytes: int,
                               kernels: Kernel = "torch") -> int:
    """Device bytes one block keeps per token for backward under `policy` with the `kernels` of
    models/kernels.py (see the module docstring for the policies without terms of their own)."""
    name = policy.base if policy.base in ACTIVATION_TERMS[kernels] else "recompute"
    saved = _bytes_per_token(ACTIVATION_TERMS[kernels][name], args, compute_bytes=compute_bytes)
    hooked = saved if name != "selective" else _bytes_per_token(
        _SHARED_TERMS["recompute"], args, compute_bytes=compute_bytes)
    return round(saved - policy.offload * hooked)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated device bytes of one rank, by part."""

    resident: int
    """Weights, optimizer state and buffers on the device for the whole step (by mode)."""
    gradients: int
    """Gradients on the device when backward ends (by mode)."""
    activations: int
    """Saved activations of one micro-batch when backward starts, plus one rebuilt block."""
    logits: int
    """One chunk of the loss's logits and their gradient."""

    @property
    def total(self) -> int:
        return self.resident + max(self.gradients, self.activations + self.logits)


@dataclass(frozen=True)
class _OpSelective:
    """The GPU-resident modes' activation_checkpoint.mode = "selective" (torchtitan's op-level
    policy, recipes/baselines/activation_checkpoint.py), by its ACTIVATION_TERMS entry: it is no
    SlideDP policy, only its memory is needed here."""

    base: str = "op_selective"
    offload: float = 0.0


_CHECKPOINTING = {"none": KEEP, "full": RECOMPUTE, "selective": _OpSelective()}
"""activation_checkpoint.mode of single and fsdp2 -> what each block keeps."""


def _policies(config, n_layers: int) -> list[ActivationPolicy]:
    if config.parallelism.mode == "slidedp":
        s = config.slidedp
        return block_policies(n_layers, default=s.activation, blocks=s.activation_blocks,
                              keep_blocks=s.keep_blocks)
    return [_CHECKPOINTING[config.activation_checkpoint.mode]] * n_layers


def _compute_bytes(config) -> int:
    """SlideDP and DeepSpeed always compute in BF16; the GPU-resident modes as training.dtype
    says."""
    bf16 = config.parallelism.mode in ("slidedp", "deepspeed") or config.training.dtype == "bf16"
    return 2 if bf16 else 4


def _resident_and_gradients(config, args: QwenArgs, *, world: int,
                            compute_bytes: int) -> tuple[int, int]:
    mode, n = config.parallelism.mode, args.num_params()
    if mode == "single":
        return n * 12 + (n * 2 if compute_bytes == 2 else 0), n * 4
    block = args.block_params()
    root = n - args.n_layers * block
    if mode == "fsdp2":
        unsharded = (root + FSDP_UNSHARDED_BLOCKS * block) * compute_bytes
        on_device = not config.parallelism.fsdp_cpu_offload  # else the shards are on the host
        resident = on_device * math.ceil(n * 12 / world) + unsharded
        return resident, on_device * math.ceil(n * 4 / world) + (root + block) * (compute_bytes + 4)
    if mode == "deepspeed":
        if config.deepspeed.zero_stage == 2:
            return n * 2, n * 2
        gathered = (root + FSDP_UNSHARDED_BLOCKS * block) * 2
        return math.ceil(n * 2 / world) + gathered, math.ceil(n * 2 / world) + block * 2
    layout = StateLayout(args, world=world)
    buffers = (config.slidedp.window_slots * layout.block_padded + layout.embed.padded
               + layout.head.padded) * 2
    grads = SLIDEDP_GRAD_COPIES * (SLIDEDP_GRAD_BLOCKS * layout.block_padded
                                   + layout.head.padded) * 2
    receive = max(u.padded for u in layout.units) // world * 2
    training = config.training
    # The runtime style's routes and host layout (slidedp/peer_styles.py).
    style = RUNTIME_STYLES[config.slidedp.runtime]
    cfg = style.configure(config.slidedp)
    cast = 0 if cfg.bf16_shadow or style.bf16_master else chunk_elems(cfg.chunk_mib) * 4
    deferred = updates_deferred(max_norm=training.max_norm, nonfinite=training.nonfinite,
                                reduction=cfg.reduction)
    plan = HostStatePlan.for_run(cfg, grad_accum_steps=training.grad_accum_steps,
                                 max_norm=training.max_norm, nonfinite=training.nonfinite)
    hold = plan.hold(n_micro=training.grad_accum_steps, reduction=cfg.reduction,
                     deferred=deferred)
    # Held on the device, the reduced shards of a step wait there for their updates: at most
    # all of them (a unit's next gradient comes after its update), while activations are freed.
    waiting = layout.total // world * 2 if hold == "device" else 0
    return buffers + grads + receive + cast, waiting


def estimate_device_memory(config, args: QwenArgs, *, world: int, kernels: Kernel = "torch",
                           block_bytes: Callable[[ActivationPolicy], float] | None = None
                           ) -> MemoryEstimate:
    """The estimate for `config` (a recipes.config.JobConfig) on `world` ranks computing with
    `kernels` (what models/kernels.py resolves [model] kernels to on the device).
    `block_bytes(policy)`: one block's device bytes per token under `policy` where they were
    measured (the planner's, slidedp/plan/workload.py), instead of the terms above."""
    training = config.training
    compute_bytes = _compute_bytes(config)
    tokens = training.local_batch_size * training.seq_len
    policies = _policies(config, args.n_layers)

    def per_block(policy: ActivationPolicy) -> float:
        if block_bytes is not None:
            return block_bytes(policy)
        return activation_bytes_per_token(args, policy, compute_bytes=compute_bytes,
                                          kernels=kernels)

    per_token = sum(per_block(p) for p in policies)
    if any(p != KEEP for p in policies):  # the block backward rebuilds (or brings back)
        per_token += per_block(KEEP)
    per_token += _bytes_per_token(STREAM_TERMS, args, compute_bytes=compute_bytes)
    resident, gradients = _resident_and_gradients(config, args, world=world,
                                                   compute_bytes=compute_bytes)
    return MemoryEstimate(
        resident=resident, gradients=gradients, activations=math.ceil(tokens * per_token),
        logits=(min(training.loss_chunk_tokens, tokens) * args.vocab_size * LOGITS_BYTES[kernels]
                + args.vocab_size * args.dim * HEAD_GRAD_BYTES[kernels]))


def largest_fitting_batch(config, args: QwenArgs, *, world: int, capacity: int,
                          kernels: Kernel = "torch") -> int:
    """The largest training.local_batch_size whose estimate fits `capacity` (0 if none does)."""
    def fits(batch: int) -> bool:
        trial = replace(config, training=replace(config.training, local_batch_size=batch))
        return estimate_device_memory(trial, args, world=world, kernels=kernels).total <= capacity

    low, high = 0, config.training.local_batch_size  # fits(low) holds, or low == 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
