"""A run's routes, one strategy class each, run by the runtime and simulated by the step-time
model (slidedp/plan/steptime.py) from the same declarations:

  delivery.py   host -> GPU: replicated, sharded
  reduction.py  GPU -> host, what a route is (its host regions, hold, bytes, simulation):
  gpu.py, cpu.py, locked.py  the reduction routes
  build.py      the checks a switch of routes must pass, and a rank's route objects

A peer runtime style (slidedp/peer_styles.py) is a composition of these. A new route is a new
module here and a line below.
"""

from slidedp.routes.cpu import CpuReturn
from slidedp.routes.delivery import Delivery, ReplicatedDelivery, ShardedDelivery
from slidedp.routes.gpu import GpuReturn
from slidedp.routes.locked import LockedReturn
from slidedp.routes.reduction import GradientReturn

DELIVERIES: dict[str, type[Delivery]] = {d.name: d for d in (ShardedDelivery,
                                                              ReplicatedDelivery)}
"""Every delivery route, by its slidedp.delivery value."""
REDUCTIONS: dict[str, type[GradientReturn]] = {r.name: r for r in (GpuReturn, CpuReturn,
                                                                    LockedReturn)}
"""Every reduction route, by its slidedp.reduction value."""
