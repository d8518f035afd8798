"""The order in which units use GPU buffers within a micro-batch, which uses need a delivery, and
where activations go to the host and come back: plain data, so a simulator can replay a plan
without the model (`dataclasses.asdict` of each Use is JSON).

Uses of one micro-batch: embed(fwd), block 0..L-1 (fwd), head (fwd+bwd), block L-1..0 (bwd),
embed(bwd). The embedding and the head have buffers of their own; blocks share `n_slots` slots.
Slots are assigned with Belady's rule (evict the block needed farthest in the future), so the
last blocks of forward are reused by backward without a second copy, and within a step blocks
still resident from the previous micro-batch are reused as well. A block whose policy offloads
activations sends them out during its forward; they start coming back one block ahead of its
backward (at the head for the last block).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Use:
    """One use of a unit's parameters on the GPU."""

    unit: int
    """Unit index (0 = embed, 1..L = blocks, L+1 = head)."""
    phase: Literal["fwd", "bwd", "head"]
    """"fwd", "bwd" or "head" (the head runs forward and backward at once)."""
    buffer: int
    """GPU buffer index: 0..n_slots-1 block slots, n_slots = embed, n_slots+1 = head."""
    deliver: bool
    """The unit must be copied into the buffer before this use."""
    offload: float = 0.0
    """A block's forward: the fraction of its saved activations that goes to host memory."""
    prefetch: int | None = None
    """A block unit whose offloaded activations start coming back before this use runs."""


def plan_micro_batch(n_blocks: int, n_slots: int, *, resident: dict[int, int],
                     embed_head_resident: bool,
                     offload: Sequence[float] = ()) -> tuple[list[Use], dict[int, int]]:
    """Plan one micro-batch. `resident` maps slot -> block unit still valid from earlier in the
    step; the returned mapping is what the slots hold afterwards. `offload[i]` is block i's
    offload fraction (none if empty)."""
    if n_slots < 2:
        raise ValueError(f"slidedp.window_slots must be >= 2, got {n_slots}")
    offload = list(offload) or [0.0] * n_blocks
    embed, head = 0, n_blocks + 1
    embed_buf, head_buf = n_slots, n_slots + 1

    def prefetch(block: int) -> int | None:  # the block unit whose backward comes next
        return block if block >= 1 and offload[block - 1] > 0 else None

    seq = ([(b, "fwd") for b in range(1, n_blocks + 1)]
           + [(b, "bwd") for b in range(n_blocks, 0, -1)])
    content = dict(resident)
    last_used = {s: -1 for s in content}
    uses = [Use(embed, "fwd", embed_buf, deliver=not embed_head_resident)]
    for k, (unit, phase) in enumerate(seq):
        if phase == "bwd" and unit == n_blocks:
            uses.append(Use(head, "head", head_buf, deliver=not embed_head_resident,
                            prefetch=prefetch(n_blocks)))
        slot = next((s for s, u in content.items() if u == unit), None)
        deliver = slot is None
        if deliver:
            free = [s for s in range(n_slots) if s not in content]
            # Farthest next use; among ties, the slot idle longest, so the copy need not wait
            # for the block that is computing right now.
            slot = free[0] if free else max(
                content, key=lambda s: (_next_use(seq, k, content[s]), -last_used[s]))
            content[slot] = unit
        last_used[slot] = k
        if phase == "fwd":
            uses.append(Use(unit, phase, slot, deliver=deliver, offload=offload[unit - 1]))
        else:
            uses.append(Use(unit, phase, slot, deliver=deliver, prefetch=prefetch(unit - 1)))
    uses.append(Use(embed, "bwd", embed_buf, deliver=False))
    return uses, content


def _next_use(seq: list[tuple[int, str]], k: int, unit: int) -> int:
    for j in range(k, len(seq)):
        if seq[j][0] == unit:
            return j
    return len(seq)  # never again in this micro-batch: the best victim
