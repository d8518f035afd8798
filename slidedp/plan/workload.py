"""The work of one micro-batch on the GPU, by unit and policy: seconds from measured timings
where the probe took them, else FLOPs at an effective rate; and each policy's activation bytes.

FLOPs per token of a block's segments (forward; backward counts twice its forward) come from
the model spec's BlockFlops (e.g. models/qwen/segments.py).
What backward replays is the forward of the segments a policy does not keep, less the last
projection of a replayed run whose output the next segment saved itself (the spec's terminal
linears: a linear's backward needs its input, not its output; torch's non-reentrant checkpoint
stops once the last saved tensor is rebuilt). `recompute` thus replays all but the block's last
projection; `selective` also skips the attention core; `ops(matmul+attention)` replays no FLOPs.
Where the rates hold a measured attention rate at this length, the attention core is timed
apart at it, its backward 2.5 times its forward (flash-style kernels rebuild the scores: 5
half-size matmuls against 2); everything else stays at the matmul rate.
The head: 2·dim·vocab per token forward, twice that backward, and with the torch kernels the
chunked loss replays each chunk's logits (once more). The embedding counts none.
"""

from dataclasses import dataclass
from itertools import groupby

from protocols.model_spec import ModelArgs, spec_of
from slidedp.activations import ActivationPolicy, BlockCost, SavedOps, SegmentMask
from slidedp.plan.memory import activation_bytes, rebuilt_bytes
from slidedp.plan.rates import Rates, model_key, timing_key

_ATTENTION_BACKWARD = 2.5
"""Attention's backward over its forward in FLOPs (5 half-size matmuls against 2)."""
SYNC_SHARE = 0.9
"""A use whose issue took at least this share of its run on the probe's device waited for the
device while it was issued (its launches alone are far shorter than its kernels)."""


def segment_flops(args: ModelArgs, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of each block segment at sequence length `seq`."""
    return spec_of(args).flops.per_token(args, seq)


def replay_flops(policy: ActivationPolicy, args: ModelArgs, seq: int) -> float:
    """FLOPs per token that backward replays under `policy` (module docstring)."""
    spec = spec_of(args)
    segments, terminal, attention = spec.segments, spec.flops.terminal_linears, spec.flops.attention
    flops = segment_flops(args, seq)
    if isinstance(policy, SavedOps):
        skip = {attention} if "attention" in policy.ops else set()
        if "matmul" in policy.ops:
            skip |= set(segments) - {attention}
        run = [s for s in segments if s not in skip]
        last = segments[-1]
        return sum(flops[s] for s in run) - (flops[last] if last in run and last in terminal
                                             else 0.0)
    assert isinstance(policy, SegmentMask)
    total = 0.0
    for kept, run in groupby(segments, key=policy.kept.__contains__):
        run = list(run)
        if not kept:
            total += sum(flops[s] for s in run)
            if run[-1] in terminal:
                total -= flops[run[-1]]
    return total


def replays_attention(policy: ActivationPolicy, args: ModelArgs) -> bool:
    """Whether backward under `policy` runs the attention core's forward again."""
    if isinstance(policy, SavedOps):
        return "attention" not in policy.ops
    return spec_of(args).flops.attention not in policy.kept


@dataclass(frozen=True)
class MicroBatchWork:
    """GPU seconds of one micro-batch's uses."""

    embed_forward: float
    embed_backward: float
    head: float
    """The head's forward and backward (they run as one use)."""
    block_forward: tuple[float, ...]
    """Per block."""
    block_backward: tuple[float, ...]
    """Per block, the policy's replay included."""
    embed_issue: tuple[float, float] = (0.0, 0.0)
    """Host seconds to issue the embedding's forward and backward (Rates.issue_s)."""
    head_issue: float = 0.0
    """Host seconds to issue the head's forward and backward."""
    head_syncs: bool = False
    """The head's issue waits for the GPU (a host read of a device value, e.g. Liger's fused
    loss counting its targets with `.item()`): the queue drains before it, and the host goes
    on only once the head has run."""
    block_issue: tuple[tuple[float, float], ...] = ()
    """Per block, host seconds to issue its forward and backward (empty: none counted)."""

    def use_seconds(self, unit: int, phase: str) -> tuple[float, float]:
        """(GPU seconds, host seconds to issue it) of the use of `unit` (0 the embedding, 1 + i
        block i) in `phase` ("fwd", "bwd", or "head": the head's forward and backward)."""
        if unit == 0:
            back = phase != "fwd"
            return (self.embed_backward if back else self.embed_forward), self.embed_issue[back]
        if phase == "head":
            return self.head, self.head_issue
        block, back = unit - 1, phase != "fwd"
        gpu = self.block_backward[block] if back else self.block_forward[block]
        return gpu, self.block_issue[block][back] if self.block_issue else 0.0

    @property
    def total(self) -> float:
        return (self.embed_forward + self.embed_backward + self.head + sum(self.block_forward)
                + sum(self.block_backward))


class Workload:
    """GPU time and activation bytes of `args` on `kernels` at `seq`, from `rates`."""

    def __init__(self, rates: Rates, args: ModelArgs, *, flavor: str, kernels: str, seq: int):
        self.rates, self.args, self.flavor, self.kernels, self.seq = rates, args, flavor, kernels, seq
        # A probe's timings and costs are of the model it ran (`rates.model`); another model's
        # blocks would pass for this one's, so they count only where the model is the same.
        self.own_timings = not rates.model or rates.model == model_key(args, kernels,
                                                                        rates.compute_dtype)

    def _flop_seconds(self, flops_per_token: float, tokens: int) -> float:
        return flops_per_token * tokens / (self.rates.tflops(self.flavor, self.kernels) * 1e12)

    def _measured(self, what: str):
        return self.rates.blocks.get(timing_key(what, self.seq)) if self.own_timings else None

    def block(self, policy: ActivationPolicy, batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of one block under `policy` for `batch` sequences (the
        offload fraction costs no GPU time: its copies run on their own stream)."""
        measured = self._measured(_base_name(policy))
        if measured is not None:
            return measured.forward_s * batch, measured.backward_s * batch
        flops = segment_flops(self.args, self.seq)
        forward, replay = sum(flops.values()), replay_flops(policy, self.args, self.seq)
        tokens = batch * self.seq
        rate = self.rates.attention(self.flavor, self.seq)
        if rate is None:
            return (self._flop_seconds(forward, tokens),
                    self._flop_seconds(2 * forward + replay, tokens))
        attention = flops[spec_of(self.args).flops.attention]
        replayed = attention if replays_attention(policy, self.args) else 0.0
        attention_s = attention * tokens / (rate * 1e12)
        return (self._flop_seconds(forward - attention, tokens) + attention_s,
                self._flop_seconds(2 * (forward - attention) + replay - replayed, tokens)
                + attention_s * (_ATTENTION_BACKWARD + replayed / attention))

    def head(self, batch: int) -> float:
        measured = self._measured("head")
        if measured is not None:
            return (measured.forward_s + measured.backward_s) * batch
        per_token = 2.0 * self.args.dim * self.args.vocab_size * (4 if self.kernels == "torch" else 3)
        return self._flop_seconds(per_token, batch * self.seq)

    def embed(self, batch: int) -> tuple[float, float]:
        measured = self._measured("embed")
        if measured is None:
            return 0.0, 0.0
        return measured.forward_s * batch, measured.backward_s * batch

    def issue(self, what: str) -> float:
        """Host seconds to issue `what` once per micro-batch, at any batch (Rates.issue_s)."""
        return self.rates.issue(self.kernels, what)

    def head_syncs(self) -> bool:
        """Whether the head's issue waited for the device when the probe timed it."""
        measured = self._measured("head")
        return measured is not None and self.issue("head") >= SYNC_SHARE * (
            measured.forward_s + measured.backward_s) * measured.batch > 0

    def micro_batch(self, policies: list[ActivationPolicy], batch: int) -> MicroBatchWork:
        per_block = [self.block(p, batch) for p in policies]
        return MicroBatchWork(*self.embed(batch), head=self.head(batch),
                              block_forward=tuple(f for f, _ in per_block),
                              block_backward=tuple(b for _, b in per_block),
                              embed_issue=(self.issue("embed/forward"), self.issue("embed/backward")),
                              head_issue=self.issue("head"), head_syncs=self.head_syncs(),
                              block_issue=tuple((self.issue(f"{_base_name(p)}/forward"),
                                                 self.issue(f"{_base_name(p)}/backward"))
                                                for p in policies))

    # ---- activation bytes ----------------------------------------------------------------------

    def cost(self, policy: ActivationPolicy) -> BlockCost | None:
        """The measured cost of `policy` (offload fraction included) at this sequence length,
        if the probe took it."""
        return self.rates.costs.get(timing_key(policy.name, self.seq)) if self.own_timings else None

    def has_measured_bytes(self, policy: ActivationPolicy) -> bool:
        return self.cost(policy) is not None

    def activation_bytes(self, policy: ActivationPolicy, batch: int) -> tuple[int, int]:
        """(GPU, host) bytes one block keeps for backward under `policy`: measured where the
        probe took it, else from the shapes (slidedp/plan/memory.py activation_bytes)."""
        cost = self.cost(policy)
        gpu, host = ((cost.gpu, cost.host) if cost is not None else
                     activation_bytes(self.args, policy, compute_bytes=2, kernels=self.kernels))
        return gpu.at(batch, self.seq), host.at(batch, self.seq)

    def rebuilt_bytes(self, policy: ActivationPolicy, batch: int) -> int:
        """GPU bytes backward holds of one block under `policy` beyond what it kept, from the
        shapes (slidedp/plan/memory.py rebuilt_bytes)."""
        return rebuilt_bytes(self.args, policy, compute_bytes=2,
                             kernels=self.kernels).at(batch, self.seq)


def _base_name(policy: ActivationPolicy) -> str:
    """Timings are per policy without its offload (offload costs the GPU stream nothing)."""
    return policy.base

