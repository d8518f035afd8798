"""The order in which units use GPU buffers within a micro-batch, and which uses need a delivery.

Uses of one micro-batch: embed(fwd), block 0..L-1 (fwd), head (fwd+bwd), block L-1..0 (bwd),
embed(bwd). The embedding and the head have buffers of their own; blocks share `n_slots` slots.
Slots are assigned with Belady's rule (evict the block needed farthest in the future), so the
last blocks of forward are reused by backward without a second copy, and within a step blocks
still resident from the previous micro-batch are reused as well.
"""

from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class Use:
    """One use of a unit's parameters on the GPU."""

    unit: int
    """Unit index (0 = embed, 1..L = blocks, L+1 = head)."""
    phase: str
    """"fwd", "bwd" or "head" (the head runs forward and backward at once)."""
    buffer: int
    """GPU buffer index: 0..n_slots-1 block slots, n_slots = embed, n_slots+1 = head."""
    deliver: bool
    """The unit must be copied into the buffer before this use."""
    release: Future = field(default_factory=Future)
    """Resolved by the compute thread with the event after this use's last kernel."""
    delivered: Future | None = None
    """Resolved by the delivery thread with the arrival event, once the copy is issued."""


def plan_micro_batch(n_blocks: int, n_slots: int, *, resident: dict[int, int],
                     embed_head_resident: bool) -> tuple[list[Use], dict[int, int]]:
    """Plan one micro-batch. `resident` maps slot -> block unit still valid from earlier in the
    step; the returned mapping is what the slots hold afterwards."""
    if n_slots < 2:
        raise ValueError(f"slidedp.window_slots must be >= 2, got {n_slots}")
    embed, head = 0, n_blocks + 1
    embed_buf, head_buf = n_slots, n_slots + 1
    seq = ([(b, "fwd") for b in range(1, n_blocks + 1)]
           + [(b, "bwd") for b in range(n_blocks, 0, -1)])
    content = dict(resident)
    last_used = {s: -1 for s in content}
    uses = [Use(embed, "fwd", embed_buf, deliver=not embed_head_resident)]
    for k, (unit, phase) in enumerate(seq):
        if phase == "bwd" and unit == n_blocks:
            uses.append(Use(head, "head", head_buf, deliver=not embed_head_resident))
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
        uses.append(Use(unit, phase, slot, deliver=deliver))
    uses.append(Use(embed, "bwd", embed_buf, deliver=False))
    return uses, content


def _next_use(seq: list[tuple[int, str]], k: int, unit: int) -> int:
    for j in range(k, len(seq)):
        if seq[j][0] == unit:
            return j
    return len(seq)  # never again in this micro-batch: the best victim
