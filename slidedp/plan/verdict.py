"""What the step-time model's simulated step says (slidedp/plan/steptime.py): the step, each
resource's busy time and service demand, the GPU's idle time by what it waited behind, the regime,
the bottleneck in words and what would move it."""

from dataclasses import dataclass
from typing import Literal

from slidedp.plan.simulate import Simulation, subtract, union_length
from slidedp.plan.step_spec import StepSpec


@dataclass(frozen=True)
class StepPrediction:
    """The model's answer for one step."""

    step_s: float
    """Predicted step time."""
    tokens_per_s: float
    busy_s: dict[str, float]
    """Seconds each resource was busy during the step (rank 0 for per-rank ones)."""
    exposed_s: dict[str, float]
    """Seconds the GPU (rank 0) sat idle while this was the first thing running (in the order
    h2d, collective, d2h, cpu update, cast, launch; "other": nothing was, e.g. a step edge)."""
    demand_s: dict[str, float]
    """Service demand per step of each resource: the seconds its work needs at its full rate
    (the busiest rank for per-rank ones); the step takes at least the largest."""
    regime: Literal["gpu-bound", "device-bound", "host-bound"]
    """host-bound: the step is more than 10% above the device's demand (device-bound: gpu-bound
    where the device is the CPU)."""
    why: str
    """The bottleneck in words."""
    advice: str
    """What would move it."""

    @property
    def bound_s(self) -> float:
        return max(self.demand_s.values())

    @property
    def bound_resource(self) -> str:
        return max(self.demand_s, key=self.demand_s.get)


_EXPOSED_ORDER = ("h2d", "collective", "inter-node", "d2h", "cpu update", "cast", "launch")
_CAPACITIES = {"h2d per GPU": "h2d:0", "d2h per GPU": "d2h:0", "host h2d": "host_h2d",
               "host d2h": "host_d2h", "host memory": "dram", "interconnect": "nvlink",
               "inter-node link": "nic:0", "cpu update": "cpu:0", "host launch": "launch:0"}
"""The resources reported, by the capacity that stands for them (rank 0's where per rank)."""
_PER_RANK = {"gpu compute": "gpu", "h2d per GPU": "h2d", "d2h per GPU": "d2h", "cpu update": "cpu",
             "host launch": "launch"}


def demands(spec: StepSpec, sim: Simulation, step: int) -> dict[str, float]:
    """Seconds of work each resource has in `step` at its full rate (the busiest rank's for the
    per-rank ones)."""
    caps, mine = sim.capacities, [t for t in sim.tasks if t.step == step]
    demand = {}
    for name in ("gpu compute", *_CAPACITIES):
        if name in _PER_RANK:
            kind = _PER_RANK[name]
            demand[name] = max(sum(t.work.get(f"{kind}:{r}", 0.0) for t in mine) / caps[f"{kind}:{r}"]
                               for r in range(spec.world))
        elif _CAPACITIES[name] in caps:  # (the link's: only over several nodes)
            cap = _CAPACITIES[name]
            demand[name] = sum(t.work.get(cap, 0.0) for t in mine) / caps[cap]
    return demand


def analyse(spec: StepSpec, sim: Simulation, t0: float, t1: float, *, last_step: int,
             device: str) -> StepPrediction:
    step = t1 - t0
    tasks = sim.tasks

    by_lane: dict[str, list] = {}
    for t in tasks:
        if t.end > t.start:
            for lane in t.lanes:
                by_lane.setdefault(lane, []).append(t)

    def on(lane: str, kinds=None) -> list[tuple[float, float]]:
        return [(t.start, t.end) for t in by_lane.get(lane, ()) if kinds is None or t.kind in kinds]

    gpu_busy = on("gpu:0") + on("gstream:0", ("gpu update",))  # GPU updates: their own stream
    idle = subtract([(t0, t1)], gpu_busy)
    exposed, left = {}, idle
    lanes0 = ("dstream:0", "ostream:0", "rstream:0", "uthread:0", "dthread:0", "gstream:0",
              "host:0")
    for kind in _EXPOSED_ORDER:
        active = [iv for lane in lanes0 for iv in on(lane, (kind,))]
        exposed[kind] = sum(b - a for a, b in left) - sum(b - a for a, b in subtract(left, active))
        left = subtract(left, active)
    exposed["other"] = sum(b - a for a, b in left)

    busy = {"gpu compute": union_length(gpu_busy, t0, t1)}
    for name, cap in _CAPACITIES.items():
        if cap in sim.capacities:
            busy[name] = union_length(
                [(a, b) for a, b, used in sim.intervals if used.get(cap, 0) > 0], t0, t1)

    demand = demands(spec, sim, last_step)
    regime, why, advice = _verdict(spec, step, demand, exposed, device=device)
    return StepPrediction(step_s=step, tokens_per_s=spec.tokens / step, busy_s=busy,
                          exposed_s=exposed, demand_s=demand, regime=regime, why=why,
                          advice=advice)


def _verdict(spec: StepSpec, step: float, demand: dict[str, float], exposed: dict[str, float],
             *, device: str):
    """The regime, the bottleneck in words and what would move it; `device` names what the
    ranks compute on ("GPU", or "device" where it is the CPU)."""
    gpu = demand["gpu compute"]
    host = {k: v for k, v in demand.items() if k != "gpu compute"}
    top = max(host, key=host.get)
    regime = "host-bound" if step > 1.1 * gpu else f"{device.lower()}-bound"
    if host[top] > gpu:
        why = f"{top} {host[top]:.3g} s vs {device} {gpu:.3g} s per step (service demand)"
        advice = _ADVICE[top](spec)
    elif regime == "host-bound":
        cause = max(exposed, key=exposed.get)
        why = (f"{device} {gpu:.3g} s of {step:.3g} s; {exposed[cause]:.3g} s of {cause} exposed "
               f"by the schedule's dependencies (every resource's demand is below the "
               f"{device}'s)")
        advice = _EXPOSED_ADVICE[cause](spec)
    else:
        why = f"{device} compute {gpu:.3g} s of {step:.3g} s; the host work is hidden"
        advice = (f"fewer replays: spend spare {device} memory on blocks that keep more "
                  "(slidedp.activation_blocks, or `python -m recipes.plan CONFIG --search`)")
        if spec.kernels == "torch" and device == "GPU":  # liger's kernels are CUDA's
            advice = "faster kernels (model.kernels = \"liger\"), or " + advice
    return regime, why, advice


def _routes_advice(spec: StepSpec) -> str:
    if spec.world > 1 and spec.delivery == "replicated":
        return "sharded delivery (each rank copies 1/R), more window_slots (fewer re-deliveries)"
    return "more window_slots (fewer re-deliveries), or more sequences per step"


_LAUNCH_ADVICE = ("more sequences per step (a block's kernels take as long to launch at any "
                  "batch)")
_ADVICE = {
    "cpu update": lambda s: "more sequences per step (training.local_batch_size or "
                            "grad_accum_steps) or more cores per rank (slidedp.cpu_threads)",
    "h2d per GPU": _routes_advice,
    "host h2d": lambda s: "sharded delivery (host reads independent of the ranks)"
                          if s.delivery == "replicated" else "fewer ranks sharing the host's PCIe",
    "d2h per GPU": lambda s: "reduction = \"gpu\" (one summed shard per rank crosses PCIe)"
                             if s.reduction == "cpu" else "more sequences per step",
    "host d2h": lambda s: "reduction = \"gpu\"" if s.reduction == "cpu" else "more sequences per step",
    "host memory": lambda s: ", ".join(
        [*(["sharded delivery (host reads independent of the ranks)"]
           if s.world > 1 and s.delivery == "replicated" else []),
         *(['reduction = "gpu" (no host sum)'] if s.reduction == "cpu" else []),
         *(["slidedp.bf16_shadow = true (no cast)"] if not s.bf16_shadow else []),
         "more sequences per step (the CPU update's 28 B/param are paid once per step)"]),
    "interconnect": lambda s: "replicated delivery (no all-gather)" if s.delivery == "sharded"
                              else "more sequences per step",
    "inter-node link": lambda s: "more sequences per step (the gradient crosses the nodes once "
                                 "per step), or a faster link",
    "host launch": lambda s: _LAUNCH_ADVICE,
}
_EXPOSED_ADVICE = {
    "h2d": _routes_advice,
    "collective": lambda s: "replicated delivery (no all-gather on the critical path)",
    "inter-node": lambda s: "more sequences per step (more backward to hide the cross-node "
                            "all-reduce behind), or a faster link",
    "d2h": lambda s: "offload less (lower @offload fractions), or reduction = \"gpu\"",
    "cpu update": lambda s: "more sequences per step hide the update behind more backward "
                            "(the last gradients' update, the embedding's, is the tail)",
    "cast": lambda s: "slidedp.bf16_shadow = true (no cast in the delivery)",
    "launch": lambda s: _LAUNCH_ADVICE,
    "other": lambda s: "more sequences per step (fewer step edges per token)",
}
