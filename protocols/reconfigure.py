"""The seam through which a caller (the bench's sweeps, AutoPolicy's live tuning, tests) changes a
runtime's settings between steps, in place of reaching into its state: one `reconfigure` call
with the knobs to change. The values are the [slidedp] keys' (slidedp/config.py), which the
runtime checks; this layer is below both and knows no choices."""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Knobs:
    """Settings to change between steps; None leaves one as it is. The host state is never
    resized: a change that needs a region it lacks is refused."""

    delivery: str | None = None
    """slidedp.delivery, the parameter route."""
    reduction: str | None = None
    """slidedp.reduction, the gradient route."""
    chunk_mib: float | None = None
    """slidedp.chunk_mib, the chunk of the copy and update pipelines."""
    window_slots: int | None = None
    """slidedp.window_slots (the slots are allocated anew)."""
    activation: str | None = None
    """slidedp.activation; activation_blocks and keep_blocks apply with it."""
    activation_blocks: str = ""
    """slidedp.activation_blocks, with `activation`."""
    keep_blocks: int = 0
    """slidedp.keep_blocks, with `activation`."""
    embedding_update: str | None = None
    """slidedp.embedding_update, checked against the routes in force after this call."""
    update_order: str | None = None
    """slidedp.update_order."""
    cpu_threads: int | None = None
    """slidedp.cpu_threads (0: this rank's share of the cores)."""

    def __post_init__(self) -> None:
        if self.activation is None and (self.activation_blocks or self.keep_blocks):
            raise ValueError("activation_blocks and keep_blocks apply with activation: name it")


class Reconfigurable(Protocol):
    """A runtime whose settings change between steps (slidedp.engine.SlideDPBackend)."""

    def reconfigure(self, knobs: Knobs) -> None:
        """Apply `knobs` after the pending updates finish; the next step runs with them."""
        ...
