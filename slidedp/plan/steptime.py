"""The step-time model: a SlideDP step simulated as the engine runs it, from a machine's rates.

The schedule is the engine's (slidedp/engine.py, docs/DESIGN.md §4-§5), replayed from the plan
data of slidedp/schedule.py for every rank, several steps in a row (version gates and deferred
updates cross step boundaries), on the lanes and capacities of slidedp/plan/step_graph.py.

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

from slidedp.gpu_update import simulate_state_copy
from slidedp.layout import chunks
from slidedp.plan.rates import Rates
from slidedp.plan.step_graph import StepGraph
from slidedp.plan.step_spec import StepSpec
from slidedp.plan.verdict import StepPrediction, analyse, demands
from slidedp.plan.workload import MicroBatchWork
from slidedp.schedule import Use, plan_micro_batch


SIMULATED_STEPS = 3
"""Steps simulated in a row; the last one is reported (the first has no version gates)."""
STEP_EDGE_S = 1e-3
"""Host work at each step's edges (the norm all-reduce, drawing the batch): about a millisecond,
not measured."""


class StepBuilder(StepGraph):
    """A run's steps as the engine schedules them, use by use and rank by rank, on the task
    graph's lanes: the routes add their own parts (slidedp/routes/: `simulate`,
    `simulate_rebuild`) with the graph's primitives."""

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
