"""Speculative updates under clipping (slidedp.speculative_update), SuperOffload-style, exact.

With clipping (or the non-finite guard) a unit's update needs the step's global norm, known only
once backward ends, so every host update waits for it. Speculatively, each unit's update runs as
soon as its gradient is home, assuming no clipping (coefficient 1), after copying the unit's
shard of the optimizer state (master, moments, their scales) to the `redo_*` regions; its
version gate stays closed. When the norm is known:
- it did not clip (and the step is finite): the coefficient was 1, so the update stands as the
  deferred one would have made it, bit for bit, and the gates open;
- it clips, or the guard skips the step: the copy is restored and the update runs again scaled
  (or not at all), from the BF16 gradient, which waits in its own buffer (not in the shadow,
  which the speculative update overwrites); a skipped step re-rounds the shadow from the
  restored master.
The cost is host memory (the state once more, plus the gradient buffer) and the copy, 2 x the
state's bytes per update; the gain is that the updates overlap backward. The step-time model
predicts both outcomes and the redo rate under which this pays (slidedp/plan/steptime.py).
"""

from slidedp.config import SlideDPConfig
from slidedp.gpu_update import gpu_updated_units
from slidedp.host_state import REDO_PREFIX, SharedHostState
from slidedp.layout import Unit



def check_speculative(cfg: SlideDPConfig, *, grad_accum_steps: int, n_layers: int) -> None:
    """Refuse what speculation cannot serve, before anything is allocated."""
    if not cfg.speculative_update:
        return
    gpu_units = bool(gpu_updated_units(cfg, n_layers))
    if cfg.reduction != "gpu" or grad_accum_steps != 1 or cfg.runtime != "slidedp" or gpu_units:
        raise ValueError('slidedp.speculative_update needs slidedp.reduction = "gpu", '
                         'training.grad_accum_steps = 1, slidedp.runtime = "slidedp" and every '
                         'update on the host (gpu_state_blocks = 0, embedding_update = "host"); '
                         f"got {cfg.reduction!r}, {grad_accum_steps}, {cfg.runtime!r}, "
                         f"{'GPU-updated units' if gpu_units else 'host updates'}")


def _shards(state: SharedHostState, unit: Unit):
    for region in state.plan.state_regions():
        yield state.shard_view(region, unit), state.shard_view(REDO_PREFIX + region, unit)


def keep(state: SharedHostState, unit: Unit) -> None:
    """Copy this rank's shard of the unit's optimizer state aside, before its speculative update."""
    for live, kept in _shards(state, unit):
        kept.copy_(live)


def restore(state: SharedHostState, unit: Unit) -> None:
    """Put the copy back: the state as it was before the speculative update."""
    for live, kept in _shards(state, unit):
        live.copy_(kept)
