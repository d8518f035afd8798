"""Device bytes one rank needs, estimated from the model's shapes before anything is allocated.

The start-up check (recipes/preflight.py) refuses a run whose estimate clearly exceeds the
device (REFUSE_ABOVE), so the estimate only has to be right to within tens of percent; it is
not a substitute for measuring peak memory.

    total = resident + max(gradients, activations + logits, after_prefetch)

Activations peak when backward starts and are freed block by block as the gradients fill in
(the GPU-resident modes drop their gradients between steps), so the two never peak together.
after_prefetch (slidedp.embedding_update = "gpu", else 0) is a later peak: this rank's shard of
the embedding's FP32 master and moments (12 B/param) and its update's temporaries (an FP32 and
a BF16 piece of the gradient, GPU_CHUNK elements at most) are on the device from the backward of
block PREFETCH_AT_BLOCK (the last block if fewer) to the update, beside what is held then: the
activations of the blocks not yet through backward, or the gradients when it ends (deferred
updates: after the step's norm, and the next forward starts once it is done).

resident and gradients (N = parameters, R = ranks) are the mode's Footprint: SlideDP's here
(slidedp_footprint), the baselines' (single, fsdp2, deepspeed) in recipes/baselines/memory.py:
    slidedp  resident: BF16 buffers (slidedp.window_slots block slots + embedding + head), the
             gradients in flight during backward (SLIDEDP_GRAD_COPIES copies of
             SLIDEDP_GRAD_BLOCKS blocks and of the head; the embedding's comes last, when the
             activations are gone), the reduce-scatter receive buffer (largest unit / R) and,
             without slidedp.bf16_shadow, the FP32 chunk that delivery casts on the device;
             gradients: 0 (they go to the host as they come), except where the reduced shards
             wait on the device for their updates (no shadow, no clipping, guard off, one
             micro-batch, gpu route: the reduction route's hold, slidedp/routes/), one
             step's: 2/R B/param
             units whose AdamW runs on the GPU (slidedp/gpu_update.py): resident ones
             (slidedp.gpu_state_blocks, embedding_update = "resident") add their shard's FP32
             master and moments and its BF16 copy (14/R B/param, 10/R with BF16 moments) and
             the update's FP32 and BF16 gradient pieces to resident; deferred, every
             GPU-updated unit's reduced shard (2/R B/param) waits on the device for the norm,
             counted in gradients

activations: tokens per micro-batch (local_batch_size x seq_len) x (the sum over blocks of the
bytes per token each block's policy keeps + what backward holds beyond that of the one block it
is at, the largest over the blocks' policies + STREAM_TERMS for the embedding output, the final
norm and the gradient flowing back); the RoPE tables a block casts count per position.

A block's bytes (activation_bytes) are counted tensor by tensor from the code, on both kernel
paths (the model spec's SavedTensors, e.g. models/qwen/segments.py: each name one storage, so a
tensor saved twice counts once; what each of the block's segments saves when it is kept), as the
engine runs each policy (slidedp/activations/policy.py):
    segment mask   each kept segment: what its ops save; each run of replayed segments (one
                   checkpoint): the run's inputs (SavedTensors.inputs: the tensors before its first
                   segment, the residual included). keep is every segment kept; recompute one
                   run, which keeps the block input.
    op-level sets  (SavedOps, and CachedOutputs: torchtitan's "selective" of the GPU-resident
                   modes): the block input, and the outputs of their ops, cached outside the
                   hooks (SavedTensors.op_outputs, or the named tensors).
    offload=f      f of the hooked bytes on the host, the cached outputs stay on the device.
What backward holds beyond that (rebuilt_bytes): the largest replayed run's saved tensors less
the run's inputs and the cached outputs (a checkpoint replays its whole run when backward first
needs one of them), plus the offloaded part brought back.

These bytes are what the engine's start-up measurement (slidedp/activations/cost.py) gives
(tests/test_plan_memory.py checks segment masks and op-level sets of both debug families on the
CPU against it; docs/PERFORMANCE.md has the GPU check). Approximate: the few fixed
bytes of an SDPA kernel (RNG seeds) are not counted; with training.dtype = "fp32" torch's FP32
copy of an FP32 tensor is the tensor itself, counted twice; mode single's autocast keeps the
residual stream in FP32 (counted in the compute dtype); what a block's backward allocates
besides the saved and rebuilt tensors (its gradients, the kernels' workspaces) is not counted.

logits: one chunk of the loss, min(loss_chunk_tokens, tokens) x vocab x LOGITS_BYTES.

Every constant that calibration may change is in the block below. They are counted from the
code; tests/test_preflight.py and tests/test_plan_memory.py hold the estimate against peaks
measured on GPUs (their bounds are the accuracy). Not checked against a GPU: mode single.
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import groupby
from typing import Literal

from protocols.model_spec import ModelArgs, SavedTensors, spec_of
from slidedp.activations import ActivationPolicy, Bytes, SavedOps, SegmentMask, block_policies
from slidedp.gpu_update import GPU_CHUNK, PREFETCH_AT_BLOCK, gpu_updated_units
from slidedp.host_state import HostStatePlan, updates_deferred
from slidedp.layout import StateLayout, chunk_elems
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.routes import REDUCTIONS
from slidedp.run_config import RunConfig, RunTraining

Kernel = Literal["liger", "torch"]
"""What models/kernels.py resolves [model] kernels to."""

# ---- calibration constants -----------------------------------------------------------------

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

SLIDEDP_GRAD_BLOCKS = 2
"""slidedp: blocks whose gradients are on the device at once (the one in backward, the one
being returned)."""
SLIDEDP_GRAD_COPIES = 2
"""slidedp: device copies of a unit's gradient (the leaves' .grad and the flat buffer sent)."""
REFUSE_ABOVE = 1.10
"""The start-up check refuses a run whose estimate exceeds the capacity by more than this."""

# ------------------------------------------------------------------------------------------------


def _stream_bytes_per_token(args: ModelArgs, *, compute_bytes: int) -> int:
    widths = spec_of(args).saved.widths(args)
    return sum(widths[w] * (fp32 * 4 + copies * compute_bytes)
               for w, (fp32, copies) in STREAM_TERMS.items())


def _tensor_bytes(names: Iterable[str], args: ModelArgs, *, compute_bytes: int) -> Bytes:
    saved, per = spec_of(args).saved, {"token": 0, "position": 0}
    widths = saved.widths(args)
    for name in names:
        width, fp32 = saved.tensors[name]
        per["position" if width == "tables" else "token"] += widths[width] * (
            4 if fp32 else compute_bytes)
    return Bytes(per_token=per["token"], per_position=per["position"], fixed=0.0)


def _runs(segments: tuple[str, ...], kept: frozenset[str]) -> list[tuple[bool, tuple[str, ...]]]:
    """A block's segments as runs of kept and of replayed ones, as SegmentMask.forward runs them."""
    return [(k, tuple(run)) for k, run in groupby(segments, key=kept.__contains__)]


def saved_tensors(policy: ActivationPolicy, args: ModelArgs,
                  kernels: Kernel) -> tuple[frozenset[str], frozenset[str]]:
    """(hooked, cached): the tensors one block keeps for backward under `policy` through
    autograd's saved-tensor hooks, and the op outputs a selective checkpoint caches beside them.
    A kept segment saves what its ops save; a run of replayed segments, one checkpoint, saves the
    run's inputs (its weights only as references). An op-level policy checkpoints the block: the
    block's input, and the outputs of its ops."""
    spec = spec_of(args)
    inputs = spec.saved.inputs
    if not isinstance(policy, SegmentMask):
        return frozenset(inputs[spec.segments[0]]), frozenset(_cached_outputs(policy, spec.saved))
    saves, hooked = spec.saved.saves(args, kernels), set()
    for kept, run in _runs(spec.segments, policy.kept):
        hooked |= set().union(*(saves[s] for s in run)) if kept else set(inputs[run[0]])
    return frozenset(hooked), frozenset()


def _cached_outputs(policy: "ActivationPolicy | CachedOutputs",
                    saved: SavedTensors) -> Iterable[str]:
    if isinstance(policy, SavedOps):
        return {name for op in policy.ops for name in saved.op_outputs[op]}
    return policy.outputs


def activation_bytes(args: ModelArgs, policy: ActivationPolicy, *, compute_bytes: int,
                     kernels: Kernel = "torch") -> tuple[Bytes, Bytes]:
    """(GPU, host) bytes one block keeps for backward under `policy`, as the engine's start-up
    measurement (slidedp/activations/cost.py) gives them: the offload fraction of the hooked
    bytes on the host, the rest and the cached op outputs on the device."""
    hooked, cached = saved_tensors(policy, args, kernels)
    hooked_bytes = _tensor_bytes(hooked, args, compute_bytes=compute_bytes)
    cached_bytes = _tensor_bytes(cached - hooked, args, compute_bytes=compute_bytes)
    return (hooked_bytes.scaled(1 - policy.offload) + cached_bytes,
            hooked_bytes.scaled(policy.offload))


def rebuilt_bytes(args: ModelArgs, policy: ActivationPolicy, *, compute_bytes: int,
                  kernels: Kernel = "torch") -> Bytes:
    """What backward holds of one block under `policy` beyond what it kept: the offloaded part,
    brought back, and the largest replayed run's saved tensors (a checkpoint replays its run
    when backward first needs one of them), less the run's inputs, which the replay reads where
    they were kept, and the op outputs a selective checkpoint caches."""
    spec = spec_of(args)
    saves, cached = spec.saved.saves(args, kernels), saved_tensors(policy, args, kernels)[1]
    kept = policy.kept if isinstance(policy, SegmentMask) else frozenset()
    runs = [set().union(*(saves[s] for s in run)) - set(spec.saved.inputs[run[0]]) - cached
            for is_kept, run in _runs(spec.segments, kept) if not is_kept]
    largest = max((_tensor_bytes(r, args, compute_bytes=compute_bytes) for r in runs),
                  key=lambda b: b.per_token, default=Bytes(0.0, 0.0, 0.0))
    return largest + activation_bytes(args, policy, compute_bytes=compute_bytes,
                                      kernels=kernels)[1]


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
    after_prefetch: int = 0
    """slidedp.embedding_update = "gpu": the embedding's state and update on the device, with
    the activations or gradients held beside them (module docstring); else 0."""

    @property
    def total(self) -> int:
        return self.resident + max(self.gradients, self.activations + self.logits,
                                   self.after_prefetch)

    def parts(self, gib: Callable[[int], str]) -> str:
        """The parts in words, each size written by `gib`, as the plan and the preflight print
        them."""
        prefetch = (f", after the embedding's prefetch {gib(self.after_prefetch)}"
                    if self.after_prefetch else "")
        return (f"resident {gib(self.resident)}, gradients {gib(self.gradients)}, activations "
                f"{gib(self.activations)}, logits {gib(self.logits)}{prefetch}")


@dataclass(frozen=True)
class CachedOutputs:
    """A block checkpoint that caches the named op outputs (SavedTensors.tensors) beside its
    input: the GPU-resident modes' op-level "selective" (recipes/baselines/memory.py). No
    SlideDP policy; only its memory is modelled."""

    outputs: frozenset[str]
    base: str = "cached_outputs"
    offload: float = 0.0


@dataclass(frozen=True)
class Footprint:
    """What one rank of a mode holds on the device besides activations and logits, and what
    each block keeps: the mode-specific part of the estimate."""

    resident: int
    """MemoryEstimate.resident."""
    gradients: int
    """MemoryEstimate.gradients."""
    policies: list
    """Per block: an ActivationPolicy or CachedOutputs."""
    compute_bytes: int
    """Bytes of the compute dtype (2 for BF16, 4 for FP32)."""
    embedding_update: int = 0
    """slidedp.embedding_update = "gpu": the embedding's state and update on the device."""


def slidedp_footprint(config: RunConfig, args: ModelArgs, *, world: int) -> Footprint:
    """SlideDP's resident buffers and held gradients (module docstring), its block policies,
    BF16 compute, and the GPU embedding update's bytes."""
    s = config.slidedp
    policies = block_policies(args.n_layers, default=s.activation, blocks=s.activation_blocks,
                              keep_blocks=s.keep_blocks)
    layout = StateLayout(args, world=world)
    buffers = (s.window_slots * layout.block_padded + layout.embed.padded
               + layout.head.padded) * 2
    grads = SLIDEDP_GRAD_COPIES * (SLIDEDP_GRAD_BLOCKS * layout.block_padded
                                   + layout.head.padded) * 2
    receive = max(u.padded for u in layout.units) // world * 2
    training = config.training
    # The runtime style's routes and host layout (slidedp/peer_styles.py).
    style = RUNTIME_STYLES[s.runtime]
    cfg = style.configure(s)
    cast = 0 if cfg.bf16_shadow or style.bf16_master else chunk_elems(cfg.chunk_mib) * 4
    deferred = updates_deferred(max_norm=training.max_norm, nonfinite=training.nonfinite,
                                reduction=cfg.reduction)
    plan = HostStatePlan.for_run(cfg, grad_accum_steps=training.grad_accum_steps,
                                 max_norm=training.max_norm, nonfinite=training.nonfinite)
    hold = REDUCTIONS[cfg.reduction].hold(plan, n_micro=training.grad_accum_steps,
                                          deferred=deferred)
    # Held on the device, the reduced shards of a step wait there for their updates: at most
    # all of them (a unit's next gradient comes after its update), while activations are freed.
    waiting = layout.total // world * 2 if hold.on_device else 0
    # The units the GPU updates (slidedp/gpu_update.py): this rank's shard of their FP32 master
    # and moments, and the update's FP32 and BF16 gradient pieces; resident ones for the whole
    # run with the shard's BF16 copy, the streamed embedding from its prefetch to its update.
    gpu = [(layout.units[i].padded // world, r) for i, r in gpu_updated_units(cfg, args.n_layers).items()]
    pieces = max((min(shard, GPU_CHUNK) * (4 + 2) for shard, _ in gpu), default=0)
    # Master 4, the moments 8 (4 when BF16: resident ones stay BF16 there), the BF16 copy 2.
    state = sum(shard * (6 + (4 if cfg.moments_dtype == "bfloat16" else 8))
                for shard, resident in gpu if resident)
    update = sum(shard * 12 for shard, resident in gpu if not resident)
    if state:
        state += pieces
    elif update:
        update += pieces
    if deferred and not hold.on_device:  # their reduced shards wait on the device for the norm
        waiting += sum(shard * 2 for shard, _ in gpu)
    return Footprint(resident=buffers + grads + receive + cast + state, gradients=waiting,
                     policies=policies, compute_bytes=2, embedding_update=update)


def estimate_device_memory(config: RunConfig, args: ModelArgs, *, world: int,
                           kernels: Kernel = "torch",
                           block_bytes: Callable[[ActivationPolicy], float] | None = None,
                           rebuild_bytes: Callable[[ActivationPolicy], float] | None = None
                           ) -> MemoryEstimate:
    """SlideDP's estimate for `config` on `world` ranks computing
    with `kernels` (what models/kernels.py resolves [model] kernels to on the device).
    `block_bytes(policy)`: one block's device bytes per token under `policy` where they were
    measured (the planner's, slidedp/plan/workload.py), instead of activation_bytes;
    `rebuild_bytes(policy)` likewise instead of rebuilt_bytes (AutoPolicy's program counts the
    rebuild apart)."""
    return estimate_memory(slidedp_footprint(config, args, world=world), config.training, args,
                           kernels=kernels, block_bytes=block_bytes, rebuild_bytes=rebuild_bytes)


def estimate_memory(footprint: Footprint, training: RunTraining, args: ModelArgs, *,
                    kernels: Kernel = "torch",
                    block_bytes: Callable[[ActivationPolicy], float] | None = None,
                    rebuild_bytes: Callable[[ActivationPolicy], float] | None = None
                    ) -> MemoryEstimate:
    """Any mode's estimate from its `footprint`: the activations its block policies keep for
    one micro-batch of `training`, the logits, and the embedding
    update's later peak (module docstring)."""
    compute_bytes = footprint.compute_bytes
    batch, seq = training.local_batch_size, training.seq_len
    tokens = batch * seq
    policies = footprint.policies

    def per_block(policy) -> float:
        if block_bytes is not None:
            return block_bytes(policy)
        gpu, _ = activation_bytes(args, policy, compute_bytes=compute_bytes, kernels=kernels)
        return gpu.at(batch, seq) / tokens

    def rebuilt(policy) -> float:
        if rebuild_bytes is not None:
            return rebuild_bytes(policy)
        return rebuilt_bytes(args, policy, compute_bytes=compute_bytes,
                             kernels=kernels).at(batch, seq) / tokens

    def held(blocks: list) -> int:
        """Bytes while `blocks` are still to go through backward: what they keep, the largest
        rebuild (one block is in backward at a time), the stream outside the blocks."""
        per_token = (sum(per_block(p) for p in blocks) + max(rebuilt(p) for p in set(blocks))
                     + _stream_bytes_per_token(args, compute_bytes=compute_bytes))
        return math.ceil(tokens * per_token)

    update, gradients = footprint.embedding_update, footprint.gradients
    prefetch_at = min(PREFETCH_AT_BLOCK, args.n_layers - 1)
    return MemoryEstimate(
        resident=footprint.resident, gradients=gradients, activations=held(policies),
        logits=(min(training.loss_chunk_tokens, tokens) * args.vocab_size * LOGITS_BYTES[kernels]
                + args.vocab_size * args.dim * HEAD_GRAD_BYTES[kernels]),
        after_prefetch=update + max(gradients, held(policies[:prefetch_at + 1])) if update else 0)
