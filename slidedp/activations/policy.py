"""Activation policies of one block, as objects the engine calls and a planner can list.

A policy decides what a block's forward saves for its backward and what the backward replays:

- `SegmentMask(kept=...)`: the block is its segments (its ModelSpec's). A kept segment runs
  under plain autograd, so what its backward needs is saved and it is never replayed. Each run of
  consecutive replayed segments runs under torch's non-reentrant checkpoint, which saves only
  the run's inputs (the boundary tensors; its weights as references) and replays the run in
  backward, stopping once the last tensor backward needs is rebuilt. Exact for any kernels,
  custom autograd Functions (liger's) included. `keep` keeps every segment; `recompute`
  none: one checkpoint over the block, which saves only the block's input.
- `SavedOps(ops=...)`: full recompute, except that forward saves the outputs of the named aten
  ops (torch's selective activation checkpointing, like torchtitan's op-level policy):
  "attention" (SDPA) and "matmul" (mm, addmm, bmm). `selective` is SavedOps(attention);
  `ops(matmul+attention)` saves every matmul and replays only the pointwise ops. Custom kernels
  are not aten ops, so with the liger kernels RMSNorm, RoPE and SwiGLU are always replayed.
- `offload=f` on either: the first f of the bytes of each storage the block saves through
  autograd's saved-tensor hooks goes to pinned host memory during forward and comes back ahead
  of backward (slidedp/activations/offload.py). Under `recompute` that is the block's input.
  SavedOps' saved op outputs stay on the GPU: torch keeps them outside those hooks.

Written forms: `keep`, `recompute`, `selective`, `segments(qkv+attention_core)`,
`ops(matmul+attention)`, each optionally followed by `@offload=F`. `name` gives the canonical
form back and `parse_policy(p.name) == p`. Per block, `block_policies` reads the [slidedp] keys
and `format_blocks` writes `activation_blocks` back, so a planner's choice round-trips through a
TOML file.
"""

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from functools import partial
from itertools import groupby
from typing import Callable

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from protocols.model_spec import known_segments

Rope = tuple[torch.Tensor, torch.Tensor]
SegmentRunner = Callable[[tuple[str, ...], tuple[torch.Tensor, ...], dict[str, torch.Tensor], Rope],
                         tuple[torch.Tensor, ...]]
"""(segment names, the tensors before the first, weights by parameter name, rope) -> the tensors
after the last (slidedp/activations/segments.py: BlockSegments, whose `names` are the block's
segments in order)."""

SEGMENTS = known_segments()
"""The segment names a SegmentMask may keep: every registered block's."""

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


OP_CLASSES: dict[str, frozenset] = {
    "matmul": _ops("mm", "addmm", "bmm"),
    "attention": _ops("_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_fused_attention_overrideable",
                      "_scaled_dot_product_flash_attention_for_cpu"),
}
"""The aten ops whose outputs SavedOps can save, by the names a policy uses."""


@dataclass(frozen=True, kw_only=True)
class ActivationPolicy(ABC):
    """What one block saves for backward; subclasses say how it runs."""

    offload: float = 0.0
    """Fraction in [0, 1] of the bytes saved through autograd's hooks that go to host memory."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload <= 1.0:
            raise ValueError(f"offload must be in [0, 1], got {self.offload!r}")

    @property
    @abstractmethod
    def base(self) -> str:
        """The name without the offload."""

    @property
    def name(self) -> str:
        """The canonical written form (parse_policy reads it back)."""
        return self.base + (f"@offload={float(self.offload)!r}" if self.offload else "")

    @property
    @abstractmethod
    def replays(self) -> str:
        """What backward recomputes, in words."""

    @property
    def cached_ops(self) -> frozenset:
        """aten ops whose outputs are saved outside autograd's saved-tensor hooks (SAC's cache)."""
        return frozenset()

    @abstractmethod
    def forward(self, segments: SegmentRunner, h: torch.Tensor, weights: dict[str, torch.Tensor],
                rope: Rope) -> torch.Tensor:
        """The block's output for input `h`, saving for backward what this policy saves."""


def _checkpointed(segments: SegmentRunner, names: tuple[str, ...],
                  state: tuple[torch.Tensor, ...], weights: dict[str, torch.Tensor], rope: Rope,
                  **kwargs) -> tuple[torch.Tensor, ...]:
    """`names` run under non-reentrant checkpoint. The weights are inputs of the checkpoint, so
    its replay takes them from the saved-tensor hooks too (WeightRefs resolves them against the
    buffer that holds the unit in backward), and their gradients reach the forward's leaves."""
    keys, n = tuple(weights), len(state)

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return segments(names, args[:n], dict(zip(keys, args[n:])), rope)

    return checkpoint(run, *state, *weights.values(), use_reentrant=False, **kwargs)


@dataclass(frozen=True, kw_only=True)
class SegmentMask(ActivationPolicy):
    """Keep the named segments, replay the others (module docstring)."""

    kept: frozenset[str] = frozenset(SEGMENTS)
    """Segments whose backward needs no replay (a block's others are replayed)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "kept", frozenset(self.kept))  # hashable whatever was given
        unknown = sorted(self.kept - set(SEGMENTS))
        if unknown:
            raise ValueError(f"unknown segment {unknown[0]!r} "
                             f"(segments: {', '.join(SEGMENTS)})")

    @property
    def base(self) -> str:
        if self.kept == frozenset(SEGMENTS):
            return "keep"
        if not self.kept:
            return "recompute"
        return f"segments({'+'.join(s for s in SEGMENTS if s in self.kept)})"

    @property
    def replays(self) -> str:
        replayed = [s for s in SEGMENTS if s not in self.kept]
        if not replayed:
            return "nothing"
        return "+".join(replayed) if self.kept else "the whole block"

    def forward(self, segments, h, weights, rope):
        state = (h,)
        for kept, run in groupby(segments.names, key=self.kept.__contains__):
            names = tuple(run)
            state = (segments(names, state, weights, rope) if kept else
                     _checkpointed(segments, names, state, weights, rope))
        return state[0]


def _save_ops(ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True, kw_only=True)
class SavedOps(ActivationPolicy):
    """Full recompute that saves the outputs of some aten ops (module docstring). With the liger
    kernels RMSNorm, RoPE and SwiGLU are custom autograd Functions, not aten ops: they are
    always replayed, whatever `ops` names."""

    ops: frozenset[str] = frozenset({"attention"})
    """Names from OP_CLASSES."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ops", frozenset(self.ops))
        if not self.ops or not self.ops <= OP_CLASSES.keys():
            raise ValueError(f"ops() takes names from {', '.join(OP_CLASSES)}, got "
                             f"{'+'.join(sorted(self.ops))!r}")

    @property
    def cached_ops(self) -> frozenset:
        return frozenset().union(*(OP_CLASSES[o] for o in self.ops))

    @property
    def base(self) -> str:
        if self.ops == {"attention"}:
            return "selective"
        return f"ops({'+'.join(o for o in OP_CLASSES if o in self.ops)})"

    @property
    def replays(self) -> str:
        return f"the whole block except the outputs of {' and '.join(sorted(self.ops))}"

    def forward(self, segments, h, weights, rope):
        context = partial(create_selective_checkpoint_contexts, partial(_save_ops, self.cached_ops))
        return _checkpointed(segments, segments.names, (h,), weights, rope,
                             context_fn=context)[0]


KEEP, RECOMPUTE, SELECTIVE = SegmentMask(), SegmentMask(kept=frozenset()), SavedOps()

_SPEC = re.compile(r"(?P<kind>[a-z_]+)(?:\((?P<args>[a-z_+]*)\))?(?:@offload=(?P<offload>[^@]+))?")
_FORMS = ("keep, recompute, selective, segments(S+S...), ops(matmul+attention); "
          "optionally @offload=F")


def parse_policy(text: str, *, key: str = "slidedp.activation") -> ActivationPolicy:
    """The policy `text` names; ValueError (one line naming `key`) if it names none."""
    spec = "".join(text.split())
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"{key}: cannot read {text!r} as an activation policy ({_FORMS})")
    kind, args, offload_text = m["kind"], m["args"], m["offload"]
    names = [a for a in (args or "").split("+") if a]
    try:
        offload = 0.0 if offload_text is None else float(offload_text)
        if len(set(names)) < len(names):
            raise ValueError("a name appears twice")
        if kind in ("keep", "recompute", "selective") and args is None:
            return replace({"keep": KEEP, "recompute": RECOMPUTE, "selective": SELECTIVE}[kind],
                           offload=offload)
        if kind == "segments" and args is not None:
            return SegmentMask(kept=frozenset(names), offload=offload)
        if kind == "ops" and args is not None:
            return SavedOps(ops=frozenset(names), offload=offload)
    except ValueError as e:
        raise ValueError(f"{key}: {text!r}: {e}") from None
    raise ValueError(f"{key}: unknown activation policy {text!r} ({_FORMS})")


def block_policies(n_blocks: int, *, default: str, blocks: str = "",
                   keep_blocks: int = 0) -> list[ActivationPolicy]:
    """Each block's policy from the [slidedp] keys: `activation` for every block, then the first
    `keep_blocks` keep, then the `activation_blocks` entries in order (a later one wins)."""
    base = parse_policy(default)
    if keep_blocks > n_blocks:
        raise ValueError(f"slidedp.keep_blocks: {keep_blocks} exceeds the model's "
                         f"{n_blocks} blocks")
    policies = [KEEP if i < keep_blocks else base for i in range(n_blocks)]
    for lo, hi, policy in _parse_blocks(blocks, n_blocks):
        policies[lo:hi + 1] = [policy] * (hi + 1 - lo)
    return policies


def _parse_blocks(text: str, n_blocks: int) -> list[tuple[int, int, ActivationPolicy]]:
    key = "slidedp.activation_blocks"
    entries = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        where, colon, spec = entry.partition(":")
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", where)
        if not colon or m is None:
            raise ValueError(f"{key}: {entry!r} is not BLOCK:POLICY or FIRST-LAST:POLICY")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi or hi >= n_blocks:
            raise ValueError(f"{key}: {entry!r}: blocks are 0..{n_blocks - 1}, first <= last")
        entries.append((lo, hi, parse_policy(spec, key=key)))
    return entries


def format_blocks(policies: list[ActivationPolicy], default: ActivationPolicy | None = None) -> str:
    """`activation_blocks` for `policies` over `activation = default.name` (the inverse of
    block_policies); every block when default is None."""
    parts, start = [], 0
    for policy, run in groupby(policies):
        n = len(list(run))
        if policy != default:
            where = f"{start}" if n == 1 else f"{start}-{start + n - 1}"
            parts.append(f"{where}:{policy.name}")
        start += n
    return ", ".join(parts)
