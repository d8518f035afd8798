"""The step-time model: a SlideDP step simulated as the engine runs it, from a machine's rates.

The schedule is the engine's (slidedp/engine.py, docs/DESIGN.md §4-§5), replayed from the plan
data of slidedp/schedule.py for every rank, several steps in a row (version gates and deferred
updates cross step boundaries), on the lanes and capacities of slidedp/plan/simulate.py:

  lanes per rank: the compute thread (host), the delivery thread, the delivery stream, the GPU
  compute stream, the offload stream, the update thread, the return stream, the embedding's
  update stream (slidedp.embedding_update = "gpu");
  capacities: each GPU, each rank's CPU threads and its launches, each GPU's H2D and D2H
  links, the host's H2D and D2H totals (a shared PCIe root: the per-GPU rate with every GPU
  copying, times the GPUs), host memory bandwidth, the GPU interconnect.

Handshakes modelled: a delivery into a buffer waits for the GPU to finish the buffer's previous
use (and, on the host, for the compute thread to have issued it); a delivery for step t+1 waits
for the unit's step-t update on every shard it reads (the version gate; the delivery thread
stops there, as the engine's does); the compute thread waits for a use's delivery to be issued;
the GPU waits for its copies (and all-gather) and for offloaded activations to come back; the
update thread takes gradient jobs one at a time in order (a unit's reduce-scatter is issued only
once the previous unit's Adam is done), copies the chunks home and runs accumulation and AdamW
chunk by chunk as they land; the cpu route's ready/consumed handshake between ranks; the end of
a step waits for the GPU and every update job, then the ranks' norm all-reduce; with clipping or
the non-finite guard the updates run after the step, in forward order, overlapping the next
step's deliveries unit by unit. Deliveries of a step are submitted when it starts, so nothing is
prefetched across a step boundary (as in the engine).

With the embedding's AdamW on the GPU (slidedp/gpu_update.py) its shard's FP32 master and moments
go to the GPU when backward reaches block PREFETCH_AT_BLOCK; its reduced gradient stays there; the
GPU updates it when the update is due (at once, or first after the norm), the delivery source
goes home, which the update thread waits for and which opens the version gate, and the rest of
the state follows on the same stream. Units whose state is resident on the GPU (slidedp.gpu_state_blocks,
embedding_update = "resident") are updated there too, first after the norm, but nothing goes
home: the update thread only issues the update, the version gate waits for it on the device,
and the unit's delivery is a copy on the GPU from its BF16 copy (the first simulated step, before
the state is there, delivers from the host). When every unit is updated there, the updates follow
the compute thread's last issue and backward on the GPU, not the host's step end (the norm is
taken on the GPU).

Over several nodes (slidedp/nodes.py, `StepSpec.nodes`) one node's ranks are simulated, every
node being alike: after the node's reduce-scatter each rank all-reduces its shard with the same
local rank of the other nodes, a ring over its NIC (slidedp/plan/link.py), on the return stream
before the shard goes home; nothing else crosses the nodes (each updates its own replica).
With the host state sharded across the nodes (`StepSpec.sharded_nodes`, slidedp/node_shards.py)
each rank owns 1/(ranks x nodes) of every unit: it copies and updates that much, and the unit's
all-gather and reduce-scatter span every node, each node receiving (sending) the other nodes'
(N-1)/N of the unit over its NICs beside the node's own collective; no all-reduce follows.

SlideFormer's data parallelism (its published design, docs/DESIGN.md §4 of the brief) is the
`schedule = "slideformer"` variant: replicated delivery cast from FP32 on the CPU, every rank
returns its full gradient, rank 0 alone sums and updates with every core, and the ranks meet at
a barrier around every chunk of the return.

The compute thread issues a use's kernels in the host seconds the probe measured for it
(Rates.issue_s, the same at any batch), and the GPU runs the use once it is issued: at few
sequences a block's launches can outlast its kernels, and the GPU waits for the host. A head
whose issue waits for the device (MicroBatchWork.head_syncs) is issued once the GPU's queue has
drained, and the compute thread goes on once it has run.

Not modelled: GPU kernels slowed by copies and collectives running beside them, the update
thread's launches of the GPU updates (a few kernels per unit), GPU memory pressure.
"""

from dataclasses import dataclass, field

from slidedp.gpu_update import PREFETCH_AT_BLOCK, simulate_gpu_update, simulate_state_copy
from slidedp.layout import chunks
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.host_pass import ADAM_BYTES, host_pass_cost
from slidedp.plan.rates import MissingRate, Rates
from slidedp.plan.simulate import Simulation
from slidedp.plan.step_spec import StepSpec
from slidedp.plan.verdict import StepPrediction, analyse, demands
from slidedp.plan.workload import MicroBatchWork
from slidedp.routes.build import route_classes
from slidedp.schedule import Use, plan_micro_batch


SIMULATED_STEPS = 3
"""Steps simulated in a row; the last one is reported (the first has no version gates)."""
STEP_EDGE_S = 1e-3
"""Host work at each step's edges (the norm all-reduce, drawing the batch): about a millisecond,
not measured."""

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


class StepBuilder:
    """The task graph of a run's steps on the simulation's lanes: the routes add their own parts
    (slidedp/routes/: `simulate`, `simulate_rebuild`) with the primitives below."""

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

    # ---- one step ------------------------------------------------------------------------------

    def build_step(self, step_start: int | None, applies: list[int] | None) -> tuple[int, list[int] | None]:
        """One step's tasks, use by use and rank by rank (each lane keeps its engine order);
        returns the step's end and its deferred updates' ends."""
        spec, R = self.spec, self.spec.world
        for rk in self.ranks:
            rk.jobs = []
        resident: dict[int, int] = {}
        submit = [step_start] * R  # what a micro-batch's delivery submission follows
        host = gpu = [None] * R
        for micro in range(spec.micro_batches):
            uses, resident = plan_micro_batch(spec.n_blocks, spec.slots,
                                              resident=resident if micro else {},
                                              embed_head_resident=micro > 0, offload=spec.offload)
            prefetched: list[dict[int, int]] = [{} for _ in range(R)]
            offloaded: list[dict[int, int]] = [{} for _ in range(R)]
            for k, use in enumerate(uses):
                gpu_s, launch_s = spec.work.use_seconds(use.unit, use.phase)
                issued = self._delivery(use, submit) if use.deliver else [(None, None)] * R
                first = step_start if micro == 0 and k == 0 else None
                # A use whose issue waits for the device is issued once the queue has drained.
                # Its measured issue is its run (the launches overlap it): no launch time apart.
                syncs = use.phase == "head" and spec.work.head_syncs
                drained, launch_s = (gpu, 0.0) if syncs else ([None] * R, launch_s)
                host, gpu = [], []
                for r, rk in enumerate(self.ranks):
                    thread_done, arrival = issued[r]
                    host.append(self.add(f"host:{r}", deps=[thread_done, first, drained[r]],
                                         work={f"launch:{r}": launch_s},
                                         kind="launch"))
                    if use.phase == "bwd" and use.unit - 1 == self.prefetch_at:
                        rk.state_on_gpu = simulate_state_copy(self, r, 12, "h2d", [host[r]])
                    if use.prefetch is not None and use.prefetch in offloaded[r]:
                        prefetched[r][use.prefetch] = self.copy(
                            f"ostream:{r}", r, spec.offload_bytes[use.prefetch - 1], "h2d",
                            [host[r], offloaded[r][use.prefetch]], kind="h2d")
                    back = prefetched[r].get(use.unit) if use.phase == "bwd" else None
                    gpu.append(self.add(f"gpu:{r}", work={f"gpu:{r}": gpu_s},
                                        deps=[host[r], arrival, back], kind="compute"))
                    if syncs:  # the host goes on once the use has run
                        host[r] = self.add(f"host:{r}", deps=[gpu[r]], kind="sync")
                    if use.phase == "fwd" and use.unit != 0 and use.offload > 0:
                        offloaded[r][use.unit] = self.copy(
                            f"ostream:{r}", r, spec.offload_bytes[use.unit - 1], "d2h", [gpu[r]],
                            kind="d2h")
                    rk.release_gpu[use.buffer], rk.release_host[use.buffer] = gpu[r], host[r]
                if use.phase in ("bwd", "head"):
                    self._gradient(use.unit, host, gpu, micro)
            submit = host  # the next micro-batch's deliveries are submitted after this one
        # The end of the step on each rank: the GPU done, every update job done (the previous
        # step's deferred updates too), then the norm all-reduce of all ranks.
        drains = []
        for r, rk in enumerate(self.ranks):
            sync = self.add(f"host:{r}", deps=[gpu[r]], kind="sync")
            drains.append(self.add(f"host:{r}", deps=[sync, *rk.jobs, *(applies or [])],
                                   kind="drain"))
        end = self.add(tuple(f"host:{r}" for r in range(R)), fixed=STEP_EDGE_S, deps=drains,
                       kind="step end")
        if not spec.waits_for_norm:
            return end, None
        # Every unit updated on the GPU: the norm is taken there and the updates are queued
        # behind backward on the GPU (engine: _norm_on_device), once the compute thread has
        # issued them, not after the host's step end.
        on_device = all(self.on_gpu(u) for u in range(len(spec.unit_elems)))
        return end, self._deferred_updates(gpu if on_device else [end] * R)

    def _owners(self, r: int) -> list[int]:
        """Ranks whose update of a unit rank r's delivery of it waits for."""
        if self.style.sole_owner:
            return [0]
        return list(self.delivery.gate_ranks(r, self.spec.world))

    def _delivery(self, use, submit) -> list[tuple[int, int]]:
        """Per rank: (the delivery thread's last task for the use, the unit's arrival)."""
        spec, R = self.spec, self.spec.world
        elems = spec.unit_elems[use.unit]
        size = self.delivery.copy_elems(elems, self.owners)
        out = []
        for r, rk in enumerate(self.ranks):
            gate = [self.ranks[o].updated.get(use.unit) for o in self._owners(r)]
            issue = self.add(f"dthread:{r}", deps=[submit[r], rk.release_host.get(use.buffer), *gate],
                             kind="gate")
            release = rk.release_gpu.get(use.buffer)
            if use.unit in spec.resident_units and self.step > 0:  # from its GPU copy
                # One rank computes from the copy in place; several copy their shard out of it,
                # once its update's kernel is done.
                seconds = 0.0 if R == 1 else 4 * size / (self.rates.hbm_gbs * 1e9)
                kernels = [self.ranks[o].on_device.get(use.unit) for o in self._owners(r)]
                arrival = self.add(f"dstream:{r}", deps=[issue, release, *kernels],
                                   work={f"gpu:{r}": seconds}, kind="d2d")
                out.append((issue, arrival))
                continue
            if spec.bf16_shadow:
                arrival = self.copy(f"dstream:{r}", r, 2 * size, "h2d", [issue, release], kind="h2d",
                                    n_chunks=len(chunks(size, spec.chunk_elems)))
                out.append((issue, arrival))
                continue
            copies, thread = [], issue  # the thread casts chunk k+1 while chunk k is in flight
            for c, n in enumerate(chunks(size, spec.chunk_elems)):
                thread = self.add(f"dthread:{r}", deps=[thread, copies[c - 2] if c >= 2 else None],
                                  work={f"cpu:{r}": 4 * n / self.rates.cast(spec.threads),
                                        "dram": 6 * n}, kind="cast")
                copies.append(self.copy(f"dstream:{r}", r, 2 * n, "h2d", [thread, release],
                                        kind="h2d"))
            out.append((thread, copies[-1]))
        return self.delivery.simulate_rebuild(self, elems, out)

    # ---- gradients -------------------------------------------------------------------------------

    def _gradient(self, unit: int, host: list[int], gpu: list[int], micro: int) -> None:
        """The update threads' job for one returned gradient (engine: _grad_job), every rank:
        the reduction route's."""
        update = micro == self.spec.micro_batches - 1 and not self.spec.waits_for_norm
        self.reduction.simulate(self, unit, host, gpu, micro, update)

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

    def _deferred_updates(self, after: list[int]) -> list[int]:
        """After the norm (rank r's updates after task after[r]): every rank updates its shards
        unit by unit in forward order (the engine's _update_job); each unit's version is stored
        when it is done."""
        spec, ends = self.spec, []
        sole = self.style.sole_owner
        for r in [0] if sole else range(spec.world):
            prev = [after[r]]
            # The GPU's first (engine: UpdateQueue), each unit in forward order.
            order = sorted(range(len(spec.unit_elems)), key=lambda u: not self.on_gpu(u))
            for unit in order:
                if self.on_gpu(unit):
                    prev = [self.gpu_update(r, unit, prev)[0]]
                    continue
                for n in chunks(spec.unit_elems[unit] if sole else spec.unit_elems[unit]
                                // self.owners, spec.chunk_elems):
                    prev = [self.host_pass(r, n, kind="adam", deps=prev, grad="fp32")]
                self.ranks[r].updated[unit] = prev[0]
            ends.append(prev[0])
        return ends

    def build(self) -> list[int]:
        """SIMULATED_STEPS steps; returns each step's end task."""
        ends, end, applies = [], None, None
        for step in range(SIMULATED_STEPS):
            self.step = step
            end, applies = self.build_step(end, applies)
            if self.spec.device_sync:  # the GPU updates' kernels too, not the host's updates
                kernels = [t for rk in self.ranks for t in rk.on_device.values()]
                end = self.add(tuple(f"host:{r}" for r in range(self.spec.world)),
                               deps=[end, *kernels], kind="sync")
            ends.append(end)
        return ends


def simulate_step(spec: StepSpec, rates: Rates) -> StepPrediction:
    """Predict one steady-state step of `spec` on the machine of `rates`."""
    builder = StepBuilder(spec, rates)
    ends = builder.build()
    sim = builder.sim
    sim.run()
    t0, t1 = sim.tasks[ends[-2]].end, sim.tasks[ends[-1]].end
    return analyse(spec, sim, t0, t1, last_step=SIMULATED_STEPS - 1,
                   device=rates.machine.device_word)


def cast_and_copy_gbs(rates: Rates, *, elems: int, gpus: int, chunk_elems: int,
                      threads: int) -> float:
    """GB/s of BF16 per GPU when `gpus` ranks (`threads` CPU threads each) at once cast an FP32
    unit of `elems` on the CPU and copy it to their GPUs: the delivery without a shadow."""
    spec = StepSpec(world=gpus, slots=2, delivery="replicated", reduction="gpu",
                    chunk_elems=chunk_elems, bf16_shadow=False, micro_batches=1, deferred=False,
                    grad_accum=False, threads=threads, cores=threads * gpus,
                    unit_elems=(0, elems, 0), work=MicroBatchWork(0.0, 0.0, 0.0, (0.0,), (0.0,)),
                    offload=(0.0,), offload_bytes=(0,), tokens=1)
    builder = StepBuilder(spec, rates)
    builder._delivery(Use(unit=1, phase="fwd", buffer=0, deliver=True), [None] * gpus)
    return 2 * elems / builder.sim.run() / 1e9


def step_demands(spec: StepSpec, rates: Rates) -> dict[str, float]:
    """The service demands of one step of `spec` (StepPrediction.demand_s) without simulating
    it: what AutoPolicy's program weighs."""
    builder = StepBuilder(spec, rates)
    builder.build_step(None, None)
    return demands(spec, builder.sim, 0)
