"""Peer systems' data-parallel designs, re-implemented as policies of this runtime.

`[slidedp] runtime` picks whose policies the engine runs. "slidedp" is this runtime's own
(docs/DESIGN.md sections 3-5). The other two re-implement the multi-GPU data parallelism of the
systems the SlideDP paper compares with, on the same engine, model, kernels and activation
policies, so that a benchmark measures the policy difference and nothing else
(docs/DESIGN.md section 10 says what each re-implements and what is approximate):

- "slideformer": every rank streams each whole layer from the host (replicated delivery) and
  returns its whole gradient (the cpu route's staging copies); rank 0 alone sums the copies and
  runs the CPU AdamW over every parameter, the other ranks run none; the ranks meet at a barrier
  after every chunk of a gradient return.
- "megatrain": the host weights are BF16, and they are the master (the FP32 Adam moments are
  kept beside them, no FP32 master): every update reads the BF16 weight, computes in FP32 and
  rounds the result back. Every rank adds its whole gradient into one shared FP32 sum under one
  host lock, and the updates run after the whole backward, ending before the step returns.

A style is data the engine reads at a few fixed points (the routes, the layout's ownership, the
hold and the end of a step); the engine never branches on its name.
"""

from dataclasses import dataclass, replace

from slidedp.config import DeliveryRoute, ReductionRoute, RuntimeName, SlideDPConfig


@dataclass(frozen=True)
class RuntimeStyle:
    """What a runtime style sets in the engine."""

    name: RuntimeName
    """The `[slidedp] runtime` value."""
    routes: tuple[DeliveryRoute, ReductionRoute] | None = None
    """The (delivery, reduction) routes the style always runs; None: the configuration's."""
    bf16_shadow: bool | None = None
    """The style's slidedp.bf16_shadow; None: the configuration's."""
    sole_owner: bool = False
    """Rank 0 owns every unit: it alone sums the returned gradients and updates the state."""
    barrier_per_chunk: bool = False
    """Every rank waits for every other after each chunk of a gradient return."""
    bf16_master: bool = False
    """The host weights are BF16 and are the master: no FP32 copy, the update rounds its FP32
    result back to BF16."""
    update_after_backward: bool = False
    """The updates wait for the whole backward and end before train_step returns (they overlap
    neither backward nor the next step's forward)."""

    def configure(self, cfg: SlideDPConfig) -> SlideDPConfig:
        """`cfg` with the style's routes and shadow in place of its own."""
        if self.routes is not None:
            cfg = replace(cfg, delivery=self.routes[0], reduction=self.routes[1])
        if self.bf16_shadow is not None:
            cfg = replace(cfg, bf16_shadow=self.bf16_shadow)
        return cfg

    def check_routes(self, delivery: str, reduction: str) -> None:
        """Refuse routes the style does not run (a switch between steps)."""
        if self.routes is not None and (delivery, reduction) != self.routes:
            raise ValueError(f"slidedp.runtime = {self.name!r} runs delivery/reduction "
                             f"{'/'.join(self.routes)}, not {delivery}/{reduction}")


RUNTIME_STYLES: dict[str, RuntimeStyle] = {s.name: s for s in (
    RuntimeStyle("slidedp"),
    RuntimeStyle("slideformer", routes=("replicated", "cpu"), bf16_shadow=True, sole_owner=True,
                 barrier_per_chunk=True),
    # The BF16 master is the delivery source itself, so there is no shadow.
    RuntimeStyle("megatrain", routes=("replicated", "locked"), bf16_shadow=False,
                 bf16_master=True, update_after_backward=True),
)}
