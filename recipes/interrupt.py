"""Ctrl-C stops a run after a whole step, with a save, every rank at the same step.

The first SIGINT only sets a flag: a KeyboardInterrupt raised wherever the main thread happens to
be (a backward, a collective, a save's join) would stop the ranks at different points, with a
traceback from each. The loop sends the flag with the step's target count (the one all-reduce
every step makes anyway, recipes/train.py), so all ranks see it after the same step, save there
(if checkpoint.save_dir is set) and end; rank 0 prints `stopped_line`, and the exit code is
EXIT_CODE. The first SIGINT also restores the default action: a second one ends the process at
once, wherever it is (as a SIGKILL would, the complete saves stay complete). Under torchrun the
terminal's Ctrl-C reaches torchrun alone, which forwards it to the ranks once (and a second one as
SIGTERM).
"""

import signal
from types import FrameType

from recipes.checkpoint import latest_checkpoint

EXIT_CODE = 128 + signal.SIGINT
"""The exit code of a run stopped by Ctrl-C (a shell's code for a process ended by SIGINT)."""

_requested = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def catch_interrupt() -> None:
    """From now on, SIGINT asks the run to stop after the step (main thread only). A process
    started with SIGINT ignored (nohup, a background job of a script) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def interrupt_requested() -> bool:
    """Whether this process got a SIGINT since `catch_interrupt`."""
    return _requested


def stopped_line(step: int, save_dir: str) -> str:
    """What rank 0 prints when the run stopped after step `step` (and its save completed)."""
    if not save_dir:
        return f"interrupted at step {step}; not saved (checkpoint.save_dir is not set)"
    return (f"interrupted at step {step}; last save {latest_checkpoint(save_dir)} (continue "
            "with --checkpoint.resume_from=latest)")
