"""The cost of one pass of the host's update thread: an AdamW pass or gradient-sum passes, in
seconds of its threads and bytes of host memory, from a machine's rates (what the step-time
model, slidedp/plan/steptime.py, puts on each rank's update thread)."""

from typing import Literal

from slidedp.plan.rates import Rates
from slidedp.plan.step_spec import StepSpec

ADAM_BYTES = {"bf16": 28, "fp32": 30}
"""Host bytes per parameter of one AdamW pass, by gradient dtype (read p, m, v, g; write p, m,
v and the BF16 shadow), with FP32 moments."""
BF16_MOMENTS_SAVE = 8
"""Bytes per parameter that BF16 moments take off that pass (m and v read and written as 2, not
4): the pass is bound by host memory traffic, so its time falls in proportion."""
STATE_BYTES = {"float32": 12, "bfloat16": 8, "8bit": 6}
"""Host bytes per parameter of the optimizer state (master and moments): a speculative update
reads and writes them once more to copy them aside, a redo to restore them."""
MOMENTS_8BIT_SAVE = 12
"""Bytes per parameter that 8-bit moments take off it (m and v as 1 byte each, plus a 4-byte
scale per 128): counted as DRAM traffic, while the pass's time is its own measured rate."""


def host_pass_cost(rates: Rates, spec: StepSpec, threads: int, elems: int, *,
                   kind: Literal["adam", "sum"], grad: str = "bf16", sources: int = 1,
                   assign: bool = True) -> tuple[float, float]:
    """(seconds, host bytes) of an AdamW pass over `elems` parameters with a `grad` gradient
    (the step's moments; with speculation, its copy aside or back), or of `sources`
    gradient-sum passes (the first assigns unless `assign` is False), on `threads` threads."""
    if kind == "adam":
        moments = spec.moments
        save = {"float32": 0, "bfloat16": BF16_MOMENTS_SAVE, "8bit": MOMENTS_8BIT_SAVE}[moments]
        per_param = ADAM_BYTES[grad] - save
        if moments == "8bit":
            seconds = elems / rates.adam_8bit(threads)
        else:
            seconds = elems / rates.adam(threads) * per_param / ADAM_BYTES["bf16"]
        # The copy aside (standing) or back (redone), bound by memory like the update.
        copy = 2 * STATE_BYTES[moments] if spec.speculative != "off" else 0
        seconds += elems / rates.adam(threads) * copy / ADAM_BYTES["bf16"]
        return seconds, elems * (per_param + copy)
    # acc = src (6 B/elem), acc += src (10 B/elem), src BF16
    return sources * elems / rates.grad_sum(threads), elems * (10 * sources - (4 if assign else 0))
