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
             micro-batch, gpu route: slidedp.host_state.HostStatePlan.hold), one step's: 2/R
             B/param
             units whose AdamW runs on the GPU (slidedp/gpu_update.py): resident ones
             (slidedp.gpu_state_blocks, embedding_update = "resident") add their shard's FP32
             master and moments and its BF16 copy (14/R B/param) and the update's FP32 and
             BF16 gradient pieces to resident; deferred, every GPU-updated unit's reduced
             shard (2/R B/param) waits on the device for the norm, counted in gradients

activations: tokens per micro-batch (local_batch_size x seq_len) x (the sum over blocks of the
bytes per token each block's policy keeps + what backward holds beyond that of the one block it
is at, the largest over the blocks' policies + STREAM_TERMS for the embedding output, the final
norm and the gradient flowing back); the RoPE tables a block casts count per position.

A block's bytes (activation_bytes) are counted tensor by tensor from the code, on both kernel
paths (TENSORS: each name one storage, so a tensor saved twice counts once; SEGMENT_SAVES: what
each of BLOCK_SEGMENTS saves when it is kept), as the engine runs each policy
(slidedp/activations/policy.py):
    segment mask   each kept segment: what its ops save; each run of replayed segments (one
                   checkpoint): the run's inputs (SEGMENT_INPUTS: the tensors before its first
                   segment, the residual included). keep is every segment kept; recompute one
                   run, which keeps the block input.
    op-level sets  (SavedOps, and CachedOutputs: torchtitan's "selective" of the GPU-resident
                   modes): the block input, and the outputs of their ops, cached outside the
                   hooks (OP_OUTPUTS, or the named tensors).
    offload=f      f of the hooked bytes on the host, the cached outputs stay on the device.
What backward holds beyond that (rebuilt_bytes): the largest replayed run's saved tensors less
the run's inputs and the cached outputs (a checkpoint replays its whole run when backward first
needs one of them), plus the offloaded part brought back.
Widths: dim; q = n_heads x head_dim; kv = n_kv_heads x head_dim; hidden = the MLP's width; heads
and kv_heads (the per-row FP32 log-sum-exp and inverse RMS); the tables 2 x head_dim per position.

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

from models.args import QwenArgs
from models.qwen import BLOCK_SEGMENTS
from slidedp.activations import ActivationPolicy, Bytes, SavedOps, SegmentMask, block_policies
from slidedp.gpu_update import GPU_CHUNK, PREFETCH_AT_BLOCK, gpu_updated_units
from slidedp.host_state import HostStatePlan, updates_deferred
from slidedp.layout import StateLayout, chunk_elems
from slidedp.peer_styles import RUNTIME_STYLES

Kernel = Literal["liger", "torch"]
"""What models/kernels.py resolves [model] kernels to."""

# ---- what one block saves for backward, segment by segment (counted from the code) --------------

TENSORS: dict[str, tuple[str, bool]] = {
    # name -> (width, FP32: else the compute dtype); "tables" are per position, the rest per token
    "x": ("dim", False), "xn": ("dim", False),                    # block input, input_norm's out
    "q0": ("q", False), "k0": ("kv", False), "v": ("kv", False),  # the q/k/v projections
    "q": ("q", False), "k": ("kv", False),                        # after QK-norm + RoPE
    "o": ("q", False), "lse": ("heads", True),                    # SDPA's output, log-sum-exp
    "o_mm": ("dim", False), "h": ("dim", False), "hn": ("dim", False),  # o_proj, + x, post_norm
    "gate": ("hidden", False), "up": ("hidden", False), "silu": ("hidden", False),
    "a": ("hidden", False), "down_mm": ("dim", False),            # a = SiLU(gate) * up
    # Inside a norm: torch's FP32 copy of the input and the normalized input before the weight;
    # on both paths the FP32 inverse RMS, one per row (per token; per head for QK-norm).
    "x32": ("dim", True), "x_normed": ("dim", False), "x_rstd": ("one", True),
    "h32": ("dim", True), "h_normed": ("dim", False), "h_rstd": ("one", True),
    "q32": ("q", True), "q_normed": ("q", False), "q_rstd": ("heads", True),
    "k32": ("kv", True), "k_normed": ("kv", False), "k_rstd": ("kv_heads", True),
    # RoPE's cos and sin cast to the compute dtype: by each rotation (torch), once (liger)
    "tables_q": ("tables", False), "tables_k": ("tables", False), "tables": ("tables", False),
}
"""The tensors of a block's forward that backward may need; a name is one storage (views, a
reshape without a copy, a tensor saved by two ops are one). SDPA writes its output in the query's
(batch, seq, heads, head_dim) layout, so o_proj's input is a view of it, not a copy."""

SEGMENT_INPUTS: dict[str, tuple[str, ...]] = {
    "input_norm": ("x",), "qkv": ("x", "xn"), "qk_norm_rope": ("x", "q0", "k0", "v"),
    "attention_core": ("x", "q", "k", "v"), "o_proj": ("x", "o"), "post_norm": ("h",),
    "mlp_up": ("h", "hn"), "down_proj": ("h", "a")}
"""What each of BLOCK_SEGMENTS takes (TransformerBlock.run_segments; the residual rides along)."""

SEGMENT_SAVES: dict[str, dict[str, tuple[str, ...]]] = {
    # kernels -> segment -> what its ops save for backward under plain autograd
    "torch": {
        "input_norm": ("x32", "x_normed", "x_rstd"), "qkv": ("xn",),  # a linear: its input
        "qk_norm_rope": ("tables_q", "tables_k"), "attention_core": ("q", "k", "v", "o", "lse"),
        "o_proj": ("o",), "post_norm": ("h32", "h_normed", "h_rstd"),
        "mlp_up": ("hn", "gate", "silu", "up"), "down_proj": ("a",)},
    # liger-kernel's autograd Functions: RMSNorm saves its input and inverse RMS, RoPE (in
    # place) its tables, SwiGLU gate and up (it recomputes SiLU)
    "liger": {
        "input_norm": ("x", "x_rstd"), "qkv": ("xn",),
        "qk_norm_rope": ("tables",), "attention_core": ("q", "k", "v", "o", "lse"),
        "o_proj": ("o",), "post_norm": ("h", "h_rstd"),
        "mlp_up": ("hn", "gate", "up"), "down_proj": ("a",)},
}
QK_NORM_SAVES: dict[str, tuple[str, ...]] = {
    "torch": ("q32", "q_normed", "q_rstd", "k32", "k_normed", "k_rstd"),
    "liger": ("q0", "q_rstd", "k0", "k_rstd")}
"""What the per-head query and key norms of qk_norm_rope add (Qwen3)."""

OP_OUTPUTS: dict[str, tuple[str, ...]] = {
    "attention": ("o", "lse"), "matmul": ("q0", "k0", "v", "o_mm", "gate", "up", "down_mm")}
"""The outputs of SavedOps' op classes (slidedp/activations/policy.py OP_CLASSES)."""

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


def _widths(args: QwenArgs) -> dict[str, int]:
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"dim": args.dim, "q": q, "kv": kv, "hidden": args.hidden_dim, "heads": args.n_heads,
            "kv_heads": args.n_kv_heads, "one": 1, "tables": 2 * args.head_dim}


def _stream_bytes_per_token(args: QwenArgs, *, compute_bytes: int) -> int:
    widths = _widths(args)
    return sum(widths[w] * (fp32 * 4 + copies * compute_bytes)
               for w, (fp32, copies) in STREAM_TERMS.items())


def _tensor_bytes(names: Iterable[str], args: QwenArgs, *, compute_bytes: int) -> Bytes:
    widths, per = _widths(args), {"token": 0, "position": 0}
    for name in names:
        width, fp32 = TENSORS[name]
        per["position" if width == "tables" else "token"] += widths[width] * (
            4 if fp32 else compute_bytes)
    return Bytes(per_token=per["token"], per_position=per["position"], fixed=0.0)


def segment_saves(args: QwenArgs, kernels: Kernel) -> dict[str, frozenset[str]]:
    """What each segment's ops save for backward when it is kept."""
    saves = {s: frozenset(names) for s, names in SEGMENT_SAVES[kernels].items()}
    if args.qk_norm:
        saves["qk_norm_rope"] |= frozenset(QK_NORM_SAVES[kernels])
    return saves


def _runs(kept: frozenset[str]) -> list[tuple[bool, tuple[str, ...]]]:
    """BLOCK_SEGMENTS as runs of kept and of replayed segments, as SegmentMask.forward runs them."""
    return [(k, tuple(run)) for k, run in groupby(BLOCK_SEGMENTS, key=kept.__contains__)]


def saved_tensors(policy: ActivationPolicy, args: QwenArgs,
                  kernels: Kernel) -> tuple[frozenset[str], frozenset[str]]:
    """(hooked, cached): the tensors one block keeps for backward under `policy` through
    autograd's saved-tensor hooks, and the op outputs a selective checkpoint caches beside them.
    A kept segment saves what its ops save; a run of replayed segments, one checkpoint, saves the
    run's inputs (its weights only as references). An op-level policy checkpoints the block: the
    block's input, and the outputs of its ops."""
    if not isinstance(policy, SegmentMask):
        return frozenset(SEGMENT_INPUTS[BLOCK_SEGMENTS[0]]), frozenset(_cached_outputs(policy))
    saves, hooked = segment_saves(args, kernels), set()
    for kept, run in _runs(policy.kept):
        hooked |= set().union(*(saves[s] for s in run)) if kept else set(SEGMENT_INPUTS[run[0]])
    return frozenset(hooked), frozenset()


def _cached_outputs(policy: "ActivationPolicy | CachedOutputs") -> Iterable[str]:
    if isinstance(policy, SavedOps):
        return {name for op in policy.ops for name in OP_OUTPUTS[op]}
    return policy.outputs


def activation_bytes(args: QwenArgs, policy: ActivationPolicy, *, compute_bytes: int,
                     kernels: Kernel = "torch") -> tuple[Bytes, Bytes]:
    """(GPU, host) bytes one block keeps for backward under `policy`, as the engine's start-up
    measurement (slidedp/activations/cost.py) gives them: the offload fraction of the hooked
    bytes on the host, the rest and the cached op outputs on the device."""
    hooked, cached = saved_tensors(policy, args, kernels)
    hooked_bytes = _tensor_bytes(hooked, args, compute_bytes=compute_bytes)
    cached_bytes = _tensor_bytes(cached - hooked, args, compute_bytes=compute_bytes)
    return (hooked_bytes.scaled(1 - policy.offload) + cached_bytes,
            hooked_bytes.scaled(policy.offload))


def rebuilt_bytes(args: QwenArgs, policy: ActivationPolicy, *, compute_bytes: int,
                  kernels: Kernel = "torch") -> Bytes:
    """What backward holds of one block under `policy` beyond what it kept: the offloaded part,
    brought back, and the largest replayed run's saved tensors (a checkpoint replays its run
    when backward first needs one of them), less the run's inputs, which the replay reads where
    they were kept, and the op outputs a selective checkpoint caches."""
    saves, cached = segment_saves(args, kernels), saved_tensors(policy, args, kernels)[1]
    kept = policy.kept if isinstance(policy, SegmentMask) else frozenset()
    runs = [set().union(*(saves[s] for s in run)) - set(SEGMENT_INPUTS[run[0]]) - cached
            for is_kept, run in _runs(kept) if not is_kept]
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
    """A block checkpoint that caches the named op outputs (TENSORS) beside its input: the
    GPU-resident modes' op-level "selective" (recipes/baselines/memory.py). No SlideDP policy;
    only its memory is modelled."""

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


def slidedp_footprint(config, args: QwenArgs, *, world: int) -> Footprint:
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
    hold = plan.hold(n_micro=training.grad_accum_steps, reduction=cfg.reduction,
                     deferred=deferred)
    # Held on the device, the reduced shards of a step wait there for their updates: at most
    # all of them (a unit's next gradient comes after its update), while activations are freed.
    waiting = layout.total // world * 2 if hold == "device" else 0
    # The units the GPU updates (slidedp/gpu_update.py): this rank's shard of their FP32 master
    # and moments, and the update's FP32 and BF16 gradient pieces; resident ones for the whole
    # run with the shard's BF16 copy, the streamed embedding from its prefetch to its update.
    gpu = [(layout.units[i].padded // world, r) for i, r in gpu_updated_units(cfg, args.n_layers).items()]
    pieces = max((min(shard, GPU_CHUNK) * (4 + 2) for shard, _ in gpu), default=0)
    state = sum(shard * 14 for shard, resident in gpu if resident)
    update = sum(shard * 12 for shard, resident in gpu if not resident)
    if state:
        state += pieces
    elif update:
        update += pieces
    if deferred and hold != "device":  # their reduced shards wait on the device for the norm
        waiting += sum(shard * 2 for shard, _ in gpu)
    return Footprint(resident=buffers + grads + receive + cast + state, gradients=waiting,
                     policies=policies, compute_bytes=2, embedding_update=update)


def estimate_device_memory(config, args: QwenArgs, *, world: int, kernels: Kernel = "torch",
                           block_bytes: Callable[[ActivationPolicy], float] | None = None,
                           rebuild_bytes: Callable[[ActivationPolicy], float] | None = None
                           ) -> MemoryEstimate:
    """SlideDP's estimate for `config` (a recipes.config.JobConfig) on `world` ranks computing
    with `kernels` (what models/kernels.py resolves [model] kernels to on the device).
    `block_bytes(policy)`: one block's device bytes per token under `policy` where they were
    measured (the planner's, slidedp/plan/workload.py), instead of activation_bytes;
    `rebuild_bytes(policy)` likewise instead of rebuilt_bytes (AutoPolicy's program counts the
    rebuild apart)."""
    return estimate_memory(slidedp_footprint(config, args, world=world), config.training, args,
                           kernels=kernels, block_bytes=block_bytes, rebuild_bytes=rebuild_bytes)


def estimate_memory(footprint: Footprint, training, args: QwenArgs, *, kernels: Kernel = "torch",
                    block_bytes: Callable[[ActivationPolicy], float] | None = None,
                    rebuild_bytes: Callable[[ActivationPolicy], float] | None = None
                    ) -> MemoryEstimate:
    """Any mode's estimate from its `footprint`: the activations its block policies keep for
    one micro-batch of `training` (recipes.config.Training), the logits, and the embedding
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
