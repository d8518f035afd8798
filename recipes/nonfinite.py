"""What the loop does about steps whose loss or gradient norm is NaN or Inf (training.nonfinite).

The backends skip such a step's update (StepResult.skipped): weights, Adam moments and Adam's
step count stay as they were. The step itself still counts: the loop's step counter and with it
the lr schedule move on, and its micro-batches are consumed. So after a skipped step k the run
continues bit for bit as one whose step k was never taken, except that step k+1 has the
learning rate of step k+1 (tests/test_nonfinite.py).
"""

import logging

logger = logging.getLogger(__name__)


class NonFiniteStop(RuntimeError):
    """Too many skipped steps (training.max_nonfinite_steps): the run stops."""


class NonFinitePolicy:
    """Counts skipped steps, warns about each and stops the run as training.nonfinite says."""

    def __init__(self, mode: str, *, limit: int, log: bool) -> None:
        """`log`: this rank prints the warnings (rank 0)."""
        self.mode, self.limit, self.log = mode, limit, log
        self.in_a_row = self.total = 0

    def observe(self, step: int, *, skipped: bool, loss: float, grad_norm: float) -> None:
        """After step `step`; raises NonFiniteStop when the limit is reached."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.log:
            logger.warning("step %d: loss %s, gradient norm %s: not finite, update skipped "
                           "(%d in a row, %d in total)", step, loss, grad_norm, self.in_a_row,
                           self.total)
        count = {"stop_consecutive": self.in_a_row, "stop_total": self.total}.get(self.mode)
        if count is not None and count >= self.limit:
            what = "in a row" if self.mode == "stop_consecutive" else "in total"
            raise NonFiniteStop(f"training.nonfinite = {self.mode!r}: {count} steps {what} had a "
                                f"non-finite loss or gradient norm (training.max_nonfinite_steps "
                                f"= {self.limit}); stopped after step {step}, the weights are "
                                "those of the last finite step")
