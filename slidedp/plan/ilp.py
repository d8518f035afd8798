"""AutoPolicy's integer program: one whole-run option (routes, slots, shadow, ...) and how many
blocks take each per-block activation policy, under the GPU and host memory budgets.

The step is modelled by its service demands: each resource r needs D_o[r] seconds per step
under option o with no per-block cost, and each block under policy p adds d_p[r] (its replay
on the GPU, its offload over PCIe). The step takes at least the largest demand, and the
schedule exposes `residual_o` more (the simulated step less its largest demand, calibrated on
measured steps when AutoPolicy runs live); a block under p adds `residual_p` besides its demands
(from the model alone, what the simulated schedule exposes of it: search.solve_modelled; live,
what the calibration measured beyond the model, per block). So,
with y_o in {0, 1} and n_p >= 0 integers:

    minimize     T + sum_o y_o residual_o + sum_p n_p residual_p
    subject to   T >= sum_o y_o D_o[r] + sum_p n_p d_p[r]          for every resource r
                 sum_o y_o = 1,  sum_p n_p = blocks
                 sum_o y_o M_o + sum_p n_p g_p + z * rebuild <= GPU budget
                 sum_o y_o F_o                                 <= GPU budget
                 sum_o y_o H_o + ranks * sum_p n_p h_p        <= host budget
                 n_p <= blocks * z for every policy that rebuilds a block in backward

M_o, H_o: the option's fixed device and host bytes (M_o what the activations add to); F_o: its
device bytes while no activation is held (the gradients at backward's end); g_p, h_p: a block's
activation bytes on the device and (offloaded, per rank) on the host; `rebuild`: the bytes of
the one block a policy other than keep rebuilds at a time (z in {0, 1}). Blocks are alike, so
counts suffice;
`objective` evaluates the same expression for a given choice (the tests check the solver's
optimum against every choice of small instances). Among choices equally fast, the one with less
device memory wins: the objective charges TIE_BREAK_S_PER_GIB for each GiB.
"""

import math
import warnings
from dataclasses import dataclass

import pulp


TIE_BREAK_S_PER_GIB = 1e-5
"""Seconds the objective charges per GiB of device memory (so equal step times prefer less)."""


@dataclass(frozen=True)
class Costs:
    """What the program weighs of an option (the whole run, the blocks' activations aside) or of
    a choice (one block under a policy)."""

    name: str
    """In words: the option's settings, the choice's policy as written."""
    demand: dict[str, float]
    """Seconds per step of each resource: an option's without the blocks' per-policy costs, a
    choice's for one block."""
    gpu_bytes: float
    """Device bytes: an option's without the blocks' activations, a choice's one block keeps."""
    host_bytes: float
    """Host bytes: an option's shared state, a choice's one block offloads (per rank)."""


@dataclass(frozen=True)
class Choice(Costs):
    """One per-block policy the program may assign."""

    rebuilds: bool
    """Backward rebuilds the block (every policy but keep)."""
    residual: float = 0.0
    """Seconds one block adds to the step beyond its demands (live: measured less modelled)."""


@dataclass(frozen=True)
class Option(Costs):
    """One whole-run setting the program may choose."""

    settings: dict
    """The [slidedp] keys it sets."""
    residual: float
    """Seconds the schedule adds beyond the largest demand."""
    gpu_floor_bytes: float = 0.0
    """Device bytes while no block's activations are held (the gradients at backward's end):
    the option fits only where these do. They do not add to the activations, which
    `gpu_bytes` does."""


@dataclass(frozen=True)
class Assignment:
    """The program's answer."""

    option: Option
    counts: dict[str, int]
    """Blocks per policy name (policies with none left out)."""
    objective: float
    """Its modelled step time."""


def device_bytes(option: Option, counts: dict[str, int], choices: dict[str, Choice]) -> float:
    """A choice's device bytes: the option's and its blocks' activations (no rebuild)."""
    return option.gpu_bytes + sum(n * choices[p].gpu_bytes for p, n in counts.items())


def objective(option: Option, counts: dict[str, int], choices: dict[str, Choice]) -> float:
    """The modelled step time of a choice, with the tie-break (the program's objective)."""
    resources = set(option.demand) | {r for c in choices.values() for r in c.demand}
    step = max(option.demand.get(r, 0.0) + sum(n * choices[p].demand.get(r, 0.0)
                                               for p, n in counts.items()) for r in resources)
    residual = option.residual + sum(n * choices[p].residual for p, n in counts.items())
    return step + residual + TIE_BREAK_S_PER_GIB * device_bytes(option, counts, choices) / 2**30


def feasible(option: Option, counts: dict[str, int], choices: dict[str, Choice], *, ranks: int,
             gpu_budget: float, host_budget: float, rebuild_bytes: float) -> bool:
    """The memory constraints of a choice."""
    rebuild = any(n and choices[p].rebuilds for p, n in counts.items())
    gpu = device_bytes(option, counts, choices)
    host = option.host_bytes + ranks * sum(n * choices[p].host_bytes for p, n in counts.items())
    return (gpu + rebuild * rebuild_bytes <= gpu_budget and host <= host_budget
            and option.gpu_floor_bytes <= gpu_budget)


def solve(options: list[Option], choices: list[Choice], *, blocks: int, ranks: int,
          gpu_budget: float, host_budget: float, rebuild_bytes: float) -> Assignment | None:
    """The optimal option and counts (None: nothing fits the budgets)."""
    prob = pulp.LpProblem("autopolicy", pulp.LpMinimize)
    y = [_variable(prob, f"option_{i}", cat="Binary") for i in range(len(options))]
    n = {c.name: _variable(prob, f"blocks_{i}", lowBound=0, upBound=blocks, cat="Integer")
         for i, c in enumerate(choices)}
    z = _variable(prob, "rebuild", cat="Binary")
    t = _variable(prob, "step", lowBound=0)
    g = 2.0**30
    prob += (t + pulp.lpSum(yo * (o.residual + TIE_BREAK_S_PER_GIB * o.gpu_bytes / g)
                            for yo, o in zip(y, options))
             + pulp.lpSum(n[c.name] * (c.residual + TIE_BREAK_S_PER_GIB * c.gpu_bytes / g)
                          for c in choices))
    prob += pulp.lpSum(y) == 1
    prob += pulp.lpSum(n.values()) == blocks
    resources = sorted({r for o in options for r in o.demand} | {r for c in choices for r in c.demand})
    for r in resources:
        prob += t >= (pulp.lpSum(yo * o.demand.get(r, 0.0) for yo, o in zip(y, options))
                      + pulp.lpSum(n[c.name] * c.demand.get(r, 0.0) for c in choices))
    for c in choices:
        if c.rebuilds:
            prob += n[c.name] <= blocks * z
    # Bytes in GiB keep the coefficients near 1 (the solver's tolerances are absolute).
    if math.isfinite(gpu_budget):
        prob += pulp.lpSum(yo * o.gpu_floor_bytes / g for yo, o in zip(y, options)) <= gpu_budget / g
        prob += (pulp.lpSum(yo * o.gpu_bytes / g for yo, o in zip(y, options))
                 + pulp.lpSum(n[c.name] * c.gpu_bytes / g for c in choices)
                 + z * rebuild_bytes / g) <= gpu_budget / g
    if math.isfinite(host_budget):
        prob += (pulp.lpSum(yo * o.host_bytes / g for yo, o in zip(y, options))
                 + ranks * pulp.lpSum(n[c.name] * c.host_bytes / g for c in choices)) <= host_budget / g
    status = prob.solve(_solver())
    if pulp.LpStatus[status] != "Optimal":
        return None
    chosen = options[max(range(len(options)), key=lambda i: y[i].value() or 0.0)]
    counts = {name: round(v.value()) for name, v in n.items() if round(v.value() or 0)}
    by_name = {c.name: c for c in choices}
    return Assignment(option=chosen, counts=counts, objective=objective(chosen, counts, by_name))


def _solver() -> pulp.LpSolver:
    """CBC: an installed one (pulp[cbc]) if there is one, else the copy pulp 3 bundles (its
    deprecation warning is for users who choose a solver; this one takes what is there)."""
    installed = pulp.COIN_CMD(msg=False)
    if installed.available():
        return installed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False)


def _variable(prob: pulp.LpProblem, name: str, **kw) -> pulp.LpVariable:
    """A variable of `prob` (pulp >= 3.3 attaches it to the problem; older ones make it free)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)
