"""The step-time model's task graph: a run's lanes and capacities on slidedp/plan/simulate.py,
and the primitives that add tasks to it, with which the engine's schedule
(slidedp/plan/steptime.py) and the routes (slidedp/routes/: `simulate`, `simulate_rebuild`)
build a step.

  lanes per rank: the compute thread (host), the delivery thread, the delivery stream, the GPU
  compute stream, the offload stream, the update thread, the return stream, the embedding's
  update stream (slidedp.embedding_update = "gpu");
  capacities: each GPU, each rank's CPU threads and its launches, each GPU's H2D and D2H
  links, the host's H2D and D2H totals (a shared PCIe root: the per-GPU rate with every GPU
  copying, times the GPUs), host memory bandwidth, the GPU interconnect.
"""

from dataclasses import dataclass, field

from slidedp.gpu_update import PREFETCH_AT_BLOCK, simulate_gpu_update
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.host_pass import ADAM_BYTES, host_pass_cost
from slidedp.plan.rates import MissingRate, Rates
from slidedp.plan.simulate import Simulation
from slidedp.plan.step_spec import StepSpec
from slidedp.routes.build import route_classes


@dataclass
class _Rank:
    """Per-rank bookkeeping while the graph is built."""

    release_gpu: dict[int, int] = field(default_factory=dict)  # buffer -> GPU task of last use
    release_host: dict[int, int] = field(default_factory=dict)  # buffer -> host task of last use
    updated: dict[int, int] = field(default_factory=dict)  # unit -> its last update, as the gate sees it
    on_device: dict[int, int] = field(default_factory=dict)  # unit -> its last GPU update's kernel
    returned: dict[int, int] = field(default_factory=dict)  # unit -> end of its last cpu-route job
    jobs: list[int] = field(default_factory=list)  # this step's update-thread job ends
    state_on_gpu: int | None = None  # the embedding's state copied to the GPU (embedding_on_gpu)


class StepGraph:
    """The task graph of a run's steps on the simulation's lanes, and the primitives that add
    to it (StepBuilder, slidedp/plan/steptime.py, adds the engine's schedule with them)."""

    def __init__(self, spec: StepSpec, rates: Rates):
        # The peer style's routes, ownership and barriers (slidedp/peer_styles.py).
        self.style = RUNTIME_STYLES[spec.schedule]
        self.style.check_routes(spec.delivery, spec.reduction)
        self.delivery, self.reduction = route_classes(spec.delivery, spec.reduction)
        # The GPU updates and the cross-node all-reduce read the reduced shard on the GPU.
        own_schedule = spec.schedule == "slidedp" and self.reduction.keeps_on_gpu
        if (spec.embedding_on_gpu or spec.resident_units) and not (
                own_schedule and spec.micro_batches == 1):
            raise ValueError("updates on the GPU need the slidedp schedule, reduction gpu and "
                             "one micro-batch")
        if spec.nodes > 1:
            if spec.link is None:
                raise MissingRate(f"{spec.nodes} nodes need an inter-node link's rates "
                                  "(--link NAME: a file of slidedp/plan/rates/links/)")
            if not own_schedule:
                raise ValueError("several nodes need the slidedp schedule and reduction gpu "
                                 "(slidedp/nodes.py)")
        if spec.sharded_nodes and (spec.delivery != "sharded" or spec.embedding_on_gpu
                                   or spec.resident_units):
            raise ValueError("a host state sharded across the nodes is delivered sharded and "
                             "updated on the host (slidedp/node_shards.py)")
        self.spec, self.rates = spec, rates
        R = spec.world
        # The ranks that own a shard of every unit: this node's, or every node's.
        self.owners = R * spec.nodes if spec.sharded_nodes else R
        caps = {"host_h2d": rates.h2d_together_gbs * 1e9 * R,
                "host_d2h": rates.d2h_together_gbs * 1e9 * R,
                # The Adam kernel's counted bytes may exceed a STREAM figure (neither counts
                # write-allocate traffic); the host delivers at least what Adam was seen to use.
                "dram": max(rates.dram_gbs * 1e9, rates.adam(spec.cores) * ADAM_BYTES["bf16"]),
                "nvlink": 1.0}
        for r in range(R):
            caps.update({f"gpu:{r}": 1.0, f"cpu:{r}": 1.0, f"launch:{r}": 1.0,
                         f"h2d:{r}": rates.h2d_gbs * 1e9,
                         f"d2h:{r}": rates.d2h_gbs * 1e9})
        if rates.uplink_gbs:
            for j in range(-(-R // rates.gpus_per_uplink)):
                caps.update({f"up_h2d:{j}": rates.uplink_gbs * 1e9, f"up_d2h:{j}": rates.uplink_gbs * 1e9})
        if spec.nodes > 1:
            caps.update({f"nic:{j}": spec.link.nic_bytes_per_s for j in range(spec.link.nics)})
        self.sim = Simulation(caps)
        self.ranks = [_Rank() for _ in range(R)]
        self.step = 0
        # The block whose backward the embedding's state is prefetched at (none: on the host).
        self.prefetch_at = min(PREFETCH_AT_BLOCK, spec.n_blocks - 1) if spec.embedding_on_gpu else None

    # ---- primitives ----------------------------------------------------------------------------

    def add(self, lanes, **kw) -> int:
        return self.sim.add(lanes, step=self.step, **kw)

    def pcie(self, r: int, nbytes: float, direction: str) -> dict[str, float]:
        """The capacities `nbytes` over rank r's PCIe link use: the link, its switch's uplink,
        the host's total."""
        work = {f"{direction}:{r}": nbytes, f"host_{direction}": nbytes}
        if self.rates.uplink_gbs:
            work[f"up_{direction}:{r // self.rates.gpus_per_uplink}"] = nbytes
        return work

    def copy(self, lane: str, r: int, nbytes: float, direction: str, deps, *, kind: str,
             n_chunks: int = 1) -> int:
        """A copy between host memory and rank r's GPU."""
        if self.rates.copy_latency_s > 0:
            deps = [self.add(lane, fixed=n_chunks * self.rates.copy_latency_s, deps=deps, kind=kind)]
        return self.add(lane, work={**self.pcie(r, nbytes, direction), "dram": nbytes}, deps=deps,
                        kind=kind)

    def collective(self, nbytes: float, gbs: float, deps, *, lane: str, kind: str) -> int:
        """An all-gather or reduce-scatter of a unit of `nbytes` over every rank; the share of
        each rank's traffic ((R-1)/R of the unit each way) that crosses PCIe uses it too."""
        R, rates = self.spec.world, self.rates
        work = {"nvlink": nbytes / (gbs * 1e9)}
        if rates.collective_pcie_share:
            traffic = rates.collective_pcie_share * nbytes * (R - 1) / R
            for r in range(R):
                for direction in ("h2d", "d2h"):
                    for k, v in self.pcie(r, traffic, direction).items():
                        work[k] = work.get(k, 0.0) + v
        fixed = rates.collective_latency_s
        if self.spec.sharded_nodes:  # the other nodes' share of the unit crosses each node's NICs
            N, link = self.spec.nodes, self.spec.link
            fixed += (N - 1) * link.latency_s
            work.update({f"nic:{j}": nbytes * (N - 1) / N / link.nics for j in range(link.nics)})
        return self.add(tuple(f"{lane}:{r}" for r in range(R)), fixed=fixed, work=work, deps=deps,
                        kind=kind)

    def across_nodes(self, r: int, nbytes: float, deps) -> int:
        """Rank r's all-reduce of its `nbytes` shard with the other nodes, over its NIC."""
        link = self.spec.link
        fixed, sent = link.all_reduce_s(nbytes, self.spec.nodes)
        return self.add(f"rstream:{r}", fixed=fixed,
                        work={f"nic:{link.nic_of(r, self.spec.world)}": sent}, deps=deps,
                        kind="inter-node")

    def threads_of(self, r: int) -> int:
        """Update threads of rank r: a sole owner (rank 0) updates with every core."""
        return self.spec.cores if self.style.sole_owner else self.spec.threads

    def host_pass(self, r: int, elems: int, *, kind: str, deps, grad: str = "bf16",
                  sources: int = 1, assign: bool = True, locked: bool = False) -> int:
        """CPU work on rank r's update thread (plan/host_pass.py's cost); `locked`: under the
        host lock that every rank's adds share (the locked route), one at a time."""
        seconds, nbytes = host_pass_cost(self.rates, self.spec, self.threads_of(r), elems,
                                         kind=kind, grad=grad, sources=sources, assign=assign)
        lanes = (f"uthread:{r}", "lock") if locked else f"uthread:{r}"
        return self.add(lanes, work={f"cpu:{r}": seconds, "dram": nbytes}, deps=deps,
                        kind="cpu update")

    # ---- gradients and updates -----------------------------------------------------------------

    def job_done(self, r: int, unit: int, end: int, update: bool) -> None:
        self.ranks[r].jobs.append(end)
        if update:
            self.ranks[r].updated[unit] = end

    def accumulate_and_update(self, r: int, n: int, deps, micro: int, update: bool, *,
                               summed: bool = False) -> list[int]:
        """Into the FP32 buffer (accumulation, clipping, the guard), then AdamW if this is the
        step's last micro-batch and updates are not deferred. `summed`: the host sum's FP32
        buffer is the gradient."""
        if self.spec.grad_accum:
            deps = [self.host_pass(r, n, kind="sum", deps=deps, assign=micro == 0)]
        if update:
            grad = "fp32" if self.spec.grad_accum or summed else "bf16"
            deps = [self.host_pass(r, n, kind="adam", deps=deps, grad=grad)]
        return deps

    def on_gpu(self, unit: int) -> bool:
        return unit in self.spec.resident_units or (unit == 0 and self.spec.embedding_on_gpu)

    def gpu_update(self, r: int, unit: int, deps) -> tuple[int, int]:
        """The unit's AdamW on rank r's GPU (slidedp/gpu_update.py's simulation of it): (the
        update thread's end of it, its kernel). The version gate opens at the first (a resident
        unit's update is issued there, the delivery thread goes on); the unit's next use on the
        GPU waits for the second."""
        end, ready = simulate_gpu_update(self, r, unit, deps)
        self.ranks[r].updated[unit], self.ranks[r].on_device[unit] = end, ready
        return end, ready
