"""The step-time model: a SlideDP step simulated as the engine runs it, from a machine's rates.

The schedule is the engine's (slidedp/engine.py, docs/DESIGN.md §4-§5), replayed from the plan
data of slidedp/schedule.py for every rank, several steps in a row (version gates and deferred
updates cross step boundaries), on the lanes and capacities of slidedp/plan/simulate.py:

  lanes per rank: the compute thread (host), the delivery thread, the delivery stream, the GPU
  compute stream, the offload stream, the update thread, the return stream, the embedding's
  update stream (slidedp.embedding_update = "gpu");
  capacities: each GPU, each rank's CPU threads, each GPU's H2D and D2H links, the host's H2D and
  D2H totals (a shared PCIe root: the per-GPU rate with every GPU copying, times the GPUs), host
  memory bandwidth, the GPU interconnect.

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

Not modelled: GPU kernels slowed by copies and collectives running beside them, the launch cost of the host threads, GPU memory pressure.
"""

from dataclasses import dataclass, field
from typing import Literal

from slidedp.config import MomentsDtype
from slidedp.gpu_update import GPU_CHUNK, PREFETCH_AT_BLOCK
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.link import Link
from slidedp.plan.rates import MissingRate, Rates
from slidedp.plan.simulate import Simulation, subtract, union_length
from slidedp.plan.workload import MicroBatchWork, chunks
from slidedp.schedule import Use, plan_micro_batch

Schedule = Literal["slidedp", "slideformer"]
Speculative = Literal["off", "stands", "redone"]

SIMULATED_STEPS = 3
"""Steps simulated in a row; the last one is reported (the first has no version gates)."""
STEP_EDGE_S = 1e-3
"""Host work at each step's edges (the norm all-reduce, drawing the batch): about a millisecond,
not measured."""
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
GPU_ADAM_BYTES = 28
"""Device bytes per parameter of an AdamW on the GPU (GpuUpdate.update, slidedp/gpu_adamw.py's
one pass): read the BF16 gradient (2) and the FP32 p, m, v (12), write p, m, v (12) and the BF16
copy of the weights (2: sent home, or the resident copy)."""


@dataclass(frozen=True)
class StepSpec:
    """Everything the model needs about one run's step."""

    world: int
    """Ranks (one GPU each) on the host."""
    slots: int
    """slidedp.window_slots."""
    delivery: str
    """"replicated" or "sharded"."""
    reduction: str
    """"gpu" or "cpu"."""
    chunk_elems: int
    """Elements per chunk of the copy and update pipelines."""
    bf16_shadow: bool
    """Deliver from the BF16 shadow (else the delivery thread casts the FP32 master)."""
    micro_batches: int
    """training.grad_accum_steps."""
    deferred: bool
    """Updates wait for the step's norm (clipping or the non-finite guard)."""
    grad_accum: bool
    """The FP32 host gradient buffer exists (accumulation, clipping or the guard)."""
    threads: int
    """CPU Adam threads per rank."""
    cores: int
    """Cores of the host (SlideFormer's rank 0 updates with all of them)."""
    unit_elems: tuple[int, ...]
    """Padded elements of each unit: embedding, blocks, head."""
    work: MicroBatchWork
    """GPU seconds of one micro-batch's uses."""
    offload: tuple[float, ...]
    """Each block's offload fraction."""
    offload_bytes: tuple[int, ...]
    """Each block's offloaded bytes per micro-batch."""
    tokens: int
    """Tokens per step over all ranks."""
    schedule: Schedule = "slidedp"
    """"slidedp", or SlideFormer's data parallelism (module docstring)."""
    kernels: str = ""
    """The model's kernels ("liger", "torch"), for the advice."""
    embedding_on_gpu: bool = False
    """The embedding's AdamW runs on the GPU, its state streamed there each step
    (slidedp.embedding_update = "gpu")."""
    resident_units: frozenset[int] = frozenset()
    """Units whose optimizer state and a BF16 copy stay on the GPU (0 the embedding, 1 + i block
    i: slidedp.gpu_state_blocks, embedding_update = "resident")."""
    moments: MomentsDtype = "float32"
    """The host's Adam moments' format (slidedp.moments_dtype)."""
    speculative: Speculative = "off"
    """Speculative updates of a deferred step (slidedp.speculative_update), as the step's norm
    turns out: "stands" (it does not clip: each update runs as its gradient comes home, after
    copying its state aside) or "redone" (it clips: the deferred updates, each after restoring
    the copy; the speculative passes themselves, which run while backward does, are not
    counted)."""
    nodes: int = 1
    """Nodes of `world` ranks each (replicated host state per node, slidedp/nodes.py); `tokens`
    counts every node's."""
    link: Link | None = None
    """The nodes' network (needed when `nodes` > 1)."""
    sharded_nodes: bool = False
    """The host state is sharded across the nodes (slidedp.nodes_state = "sharded"): every rank
    of every node owns a shard, and the collectives span the nodes."""

    @property
    def waits_for_norm(self) -> bool:
        """The host updates run after the step's norm (deferred, and not standing speculations)."""
        return self.deferred and self.speculative != "stands"

    @property
    def n_blocks(self) -> int:
        return len(self.unit_elems) - 2


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
    h2d, collective, d2h, cpu update, cast; "other": nothing was, e.g. a step edge)."""
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


@dataclass
class _Rank:
    """Per-rank bookkeeping while the graph is built."""

    release_gpu: dict[int, int] = field(default_factory=dict)  # buffer -> GPU task of last use
    release_host: dict[int, int] = field(default_factory=dict)  # buffer -> host task of last use
    updated: dict[int, int] = field(default_factory=dict)  # unit -> task ending its last update
    returned: dict[int, int] = field(default_factory=dict)  # unit -> end of its last cpu-route job
    jobs: list[int] = field(default_factory=list)  # this step's update-thread job ends
    state_on_gpu: int | None = None  # the embedding's state copied to the GPU (embedding_on_gpu)


class _Builder:
    def __init__(self, spec: StepSpec, rates: Rates):
        # The peer style's routes, ownership and barriers (slidedp/peer_styles.py).
        self.style = RUNTIME_STYLES[spec.schedule]
        self.style.check_routes(spec.delivery, spec.reduction)
        if (spec.embedding_on_gpu or spec.resident_units) and (
                spec.schedule, spec.reduction, spec.micro_batches) != ("slidedp", "gpu", 1):
            raise ValueError("updates on the GPU need the slidedp schedule, reduction gpu and "
                             "one micro-batch")
        if spec.nodes > 1:
            if spec.link is None:
                raise MissingRate(f"{spec.nodes} nodes need an inter-node link's rates "
                                  "(--link NAME: a file of slidedp/plan/rates/links/)")
            if (spec.schedule, spec.reduction) != ("slidedp", "gpu"):
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
            caps.update({f"gpu:{r}": 1.0, f"cpu:{r}": 1.0, f"h2d:{r}": rates.h2d_gbs * 1e9,
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
                  sources: int = 1, assign: bool = True) -> int:
        """CPU work on rank r's update thread: an AdamW pass, or `sources` gradient-sum passes
        (the first assigns unless `assign` is False)."""
        rates, threads = self.rates, self.threads_of(r)
        if kind == "adam":
            moments = self.spec.moments
            save = {"float32": 0, "bfloat16": BF16_MOMENTS_SAVE, "8bit": MOMENTS_8BIT_SAVE}[moments]
            per_param = ADAM_BYTES[grad] - save
            if moments == "8bit":
                seconds = elems / rates.adam_8bit(threads)
            else:
                seconds = elems / rates.adam(threads) * per_param / ADAM_BYTES["bf16"]
            # The copy aside (standing) or back (redone), bound by memory like the update.
            copy = 2 * STATE_BYTES[moments] if self.spec.speculative != "off" else 0
            seconds += elems / rates.adam(threads) * copy / ADAM_BYTES["bf16"]
            nbytes = elems * (per_param + copy)
        else:  # acc = src (6 B/elem), acc += src (10 B/elem), src BF16
            seconds = sources * elems / rates.grad_sum(threads)
            nbytes = elems * (10 * sources - (4 if assign else 0))
        return self.add(f"uthread:{r}", work={f"cpu:{r}": seconds, "dram": nbytes}, deps=deps,
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
                issued = self._delivery(use, submit) if use.deliver else [(None, None)] * R
                first = step_start if micro == 0 and k == 0 else None
                host, gpu = [], []
                for r, rk in enumerate(self.ranks):
                    thread_done, arrival = issued[r]
                    host.append(self.add(f"host:{r}", deps=[thread_done, first], kind="issue"))
                    if use.phase == "bwd" and use.unit - 1 == self.prefetch_at:
                        rk.state_on_gpu = self._state_copy(r, 12, "h2d", [host[r]])
                    if use.prefetch is not None and use.prefetch in offloaded[r]:
                        prefetched[r][use.prefetch] = self.copy(
                            f"ostream:{r}", r, spec.offload_bytes[use.prefetch - 1], "h2d",
                            [host[r], offloaded[r][use.prefetch]], kind="h2d")
                    back = prefetched[r].get(use.unit) if use.phase == "bwd" else None
                    gpu.append(self.add(f"gpu:{r}", work={f"gpu:{r}": self._gpu_seconds(use)},
                                        deps=[host[r], arrival, back], kind="compute"))
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
        # behind backward (engine: _norm_on_device), not after the host's step end.
        on_device = all(self._on_gpu(u) for u in range(len(spec.unit_elems)))
        return end, self._deferred_updates(host if on_device else [end] * R)

    def _owners(self, r: int) -> list[int]:
        """Ranks whose update of a unit rank r's delivery of it waits for."""
        if self.style.sole_owner:
            return [0]
        return [r] if self.spec.delivery == "sharded" else list(range(self.spec.world))

    def _delivery(self, use, submit) -> list[tuple[int, int]]:
        """Per rank: (the delivery thread's last task for the use, the unit's arrival)."""
        spec, R = self.spec, self.spec.world
        elems = spec.unit_elems[use.unit]
        size = elems if spec.delivery == "replicated" or self.owners == 1 else elems // self.owners
        out = []
        for r, rk in enumerate(self.ranks):
            gate = [self.ranks[o].updated.get(use.unit) for o in self._owners(r)]
            issue = self.add(f"dthread:{r}", deps=[submit[r], rk.release_host.get(use.buffer), *gate],
                             kind="gate")
            release = rk.release_gpu.get(use.buffer)
            if use.unit in spec.resident_units and self.step > 0:  # from its GPU copy
                # One rank computes from the copy in place; several copy their shard out of it.
                seconds = 0.0 if R == 1 else 4 * size / (self.rates.hbm_gbs * 1e9)
                arrival = self.add(f"dstream:{r}", deps=[issue, release],
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
        if spec.delivery == "sharded" and self.owners > 1:
            gathered = self.collective(2 * elems, self.rates.all_gather_gbs, [a for _, a in out],
                                       lane="dstream", kind="collective")
            out = [(t, gathered) for t, _ in out]
        return out

    def _gpu_seconds(self, use) -> float:
        w = self.spec.work
        if use.unit == 0:
            return w.embed_forward if use.phase == "fwd" else w.embed_backward
        if use.phase == "head":
            return w.head
        block = use.unit - 1
        return w.block_forward[block] if use.phase == "fwd" else w.block_backward[block]

    # ---- gradients -------------------------------------------------------------------------------

    def _gradient(self, unit: int, host: list[int], gpu: list[int], micro: int) -> None:
        """The update threads' job for one returned gradient (engine: _grad_job), every rank."""
        spec, R = self.spec, self.spec.world
        update = micro == spec.micro_batches - 1 and not spec.waits_for_norm
        if self.style.sole_owner:
            return self._sole_owner_gradient(unit, host, gpu, micro, update)
        elems = spec.unit_elems[unit]
        if spec.reduction == "gpu":
            starts = [self.add(f"uthread:{r}", deps=[host[r]], kind="issue") for r in range(R)]
            if self.owners > 1:  # every rank's update thread must have issued it: one collective
                reduced = [self.collective(2 * elems, self.rates.reduce_scatter_gbs,
                                           [*starts, *gpu], lane="rstream", kind="collective")] * R
            else:
                reduced = [self.add("rstream:0", deps=[starts[0], gpu[0]], kind="issue")]
            if spec.nodes > 1 and not spec.sharded_nodes:
                reduced = [self.across_nodes(r, 2 * elems // R, [reduced[r]]) for r in range(R)]
            for r in range(R):
                if self._on_gpu(unit):  # the reduced shard waits on the GPU for its update
                    end, ready = (self._gpu_update(r, unit, [reduced[r]]) if update
                                  else (reduced[r], reduced[r]))
                    self.ranks[r].jobs.append(end)
                    if update:
                        self.ranks[r].updated[unit] = ready
                    continue
                copies = [self.copy(f"rstream:{r}", r, 2 * n, "d2h", [reduced[r]], kind="d2h")
                          for n in chunks(elems // self.owners, spec.chunk_elems)]  # issued at once
                prev: list = []
                for n, landed in zip(chunks(elems // self.owners, spec.chunk_elems), copies):
                    prev = self._accumulate_and_update(r, n, [landed, *prev], micro, update)
                self._job_done(r, unit, prev[0], update)
            return
        # cpu route: wait until every owner consumed our previous copy, return the whole
        # gradient, wait until every rank's is home, sum our shard of the R copies chunk by chunk.
        homes = []
        for r in range(R):
            consumed = [self.ranks[o].returned.get(unit) for o in range(R)]
            start = self.add(f"uthread:{r}", deps=[host[r], *consumed], kind="issue")
            homes.append(self.copy(f"rstream:{r}", r, 2 * elems, "d2h", [start, gpu[r]], kind="d2h",
                                   n_chunks=len(chunks(elems, spec.chunk_elems))))
        for r in range(R):
            prev = homes
            for n in chunks(elems // R, spec.chunk_elems):
                prev = [self.host_pass(r, n, kind="sum", deps=prev, sources=R)]
                prev = self._accumulate_and_update(r, n, prev, micro, update, summed=True)
            self.ranks[r].returned[unit] = prev[0]
            self._job_done(r, unit, prev[0], update)

    def _job_done(self, r: int, unit: int, end: int, update: bool) -> None:
        self.ranks[r].jobs.append(end)
        if update:
            self.ranks[r].updated[unit] = end

    def _accumulate_and_update(self, r: int, n: int, deps, micro: int, update: bool, *,
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

    def _sole_owner_gradient(self, unit: int, host: list[int], gpu: list[int], micro: int,
                             update: bool) -> None:
        """Every rank copies its full gradient home chunk by chunk; rank 0 sums the R copies of
        each chunk and updates it; the ranks meet before each chunk's copy and after its update
        (the style's barrier per chunk)."""
        spec, R = self.spec, self.spec.world
        consumed = self.ranks[0].returned.get(unit)
        starts = [self.add(f"uthread:{r}", deps=[host[r], consumed], kind="issue") for r in range(R)]
        barrier = None
        for n in chunks(spec.unit_elems[unit], spec.chunk_elems):
            copies = [self.copy(f"rstream:{r}", r, 2 * n, "d2h", [starts[r], gpu[r], barrier],
                                kind="d2h") for r in range(R)]
            done = [self.host_pass(0, n, kind="sum", deps=copies, sources=R)]
            barrier = self._accumulate_and_update(0, n, done, micro, update, summed=True)[0]
        self.ranks[0].returned[unit] = barrier
        for r in range(R):
            self.ranks[r].jobs.append(barrier)
        if update:
            self.ranks[0].updated[unit] = barrier

    def _on_gpu(self, unit: int) -> bool:
        return unit in self.spec.resident_units or (unit == 0 and self.spec.embedding_on_gpu)

    def _state_copy(self, r: int, per_elem: int, direction: str, deps) -> int:
        """`per_elem` bytes per element of rank r's embedding shard between the host and its GPU
        on the update stream: a copy per region (4 B/elem each, the BF16 shadow one) per piece of
        GPU_CHUNK elements."""
        shard = self.spec.unit_elems[0] // self.spec.world
        return self.copy(f"gstream:{r}", r, per_elem * shard, direction, deps, kind=direction,
                         n_chunks=len(chunks(shard, GPU_CHUNK)) * -(-per_elem // 4))

    def _gpu_update(self, r: int, unit: int, deps) -> tuple[int, int]:
        """The unit's AdamW on rank r's GPU (engine: GpuUpdate.update): (the update thread's end
        of it, what the version gate waits for). Streamed (the embedding): its delivery source
        goes home, which the update thread waits for, and the rest of its state after it.
        Resident: the thread only issues it; the gate waits for it on the device."""
        shard, shadow = self.spec.unit_elems[unit] // self.spec.world, self.spec.bf16_shadow
        seconds = shard * GPU_ADAM_BYTES / (self.rates.hbm_gbs * 1e9)
        if unit in self.spec.resident_units:
            issued = self.add(f"uthread:{r}", deps=deps, kind="issue")
            return issued, self.add(f"gpu:{r}", work={f"gpu:{r}": seconds}, deps=[issued],
                                    kind="gpu update")
        adam = self.add(f"gpu:{r}", work={f"gpu:{r}": seconds},
                        deps=[*deps, self.ranks[r].state_on_gpu], kind="gpu update")
        home = self._state_copy(r, 2 if shadow else 4, "d2h", [adam])
        self._state_copy(r, 12 if shadow else 8, "d2h", [home])  # waited for by the next prefetch
        synced = self.add(f"uthread:{r}", deps=[home], kind="sync")
        return synced, synced

    def _deferred_updates(self, after: list[int]) -> list[int]:
        """After the norm (rank r's updates after task after[r]): every rank updates its shards
        unit by unit in forward order (the engine's _update_job); each unit's version is stored
        when it is done."""
        spec, ends = self.spec, []
        sole = self.style.sole_owner
        for r in [0] if sole else range(spec.world):
            prev = [after[r]]
            # The GPU's first (engine: UpdateQueue), each unit in forward order.
            order = sorted(range(len(spec.unit_elems)), key=lambda u: not self._on_gpu(u))
            for unit in order:
                if self._on_gpu(unit):
                    end, ready = self._gpu_update(r, unit, prev)
                    prev = [end]
                else:
                    for n in chunks(spec.unit_elems[unit] if sole else spec.unit_elems[unit]
                                    // self.owners, spec.chunk_elems):
                        prev = [self.host_pass(r, n, kind="adam", deps=prev, grad="fp32")]
                    ready = prev[0]
                self.ranks[r].updated[unit] = ready
            ends.append(prev[0])
        return ends

    def build(self) -> list[int]:
        """SIMULATED_STEPS steps; returns each step's end task."""
        ends, end, applies = [], None, None
        for step in range(SIMULATED_STEPS):
            self.step = step
            end, applies = self.build_step(end, applies)
            ends.append(end)
        return ends


def simulate_step(spec: StepSpec, rates: Rates) -> StepPrediction:
    """Predict one steady-state step of `spec` on the machine of `rates`."""
    builder = _Builder(spec, rates)
    ends = builder.build()
    sim = builder.sim
    sim.run()
    t0, t1 = sim.tasks[ends[-2]].end, sim.tasks[ends[-1]].end
    return _analyse(spec, sim, t0, t1, last_step=SIMULATED_STEPS - 1,
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
    builder = _Builder(spec, rates)
    builder._delivery(Use(unit=1, phase="fwd", buffer=0, deliver=True), [None] * gpus)
    return 2 * elems / builder.sim.run() / 1e9


def step_demands(spec: StepSpec, rates: Rates) -> dict[str, float]:
    """The service demands of one step of `spec` (StepPrediction.demand_s) without simulating
    it: what AutoPolicy's program weighs."""
    builder = _Builder(spec, rates)
    builder.build_step(None, None)
    return _demands(spec, builder.sim, 0)


_EXPOSED_ORDER = ("h2d", "collective", "inter-node", "d2h", "cpu update", "cast")
_CAPACITIES = {"h2d per GPU": "h2d:0", "d2h per GPU": "d2h:0", "host h2d": "host_h2d",
               "host d2h": "host_d2h", "host memory": "dram", "interconnect": "nvlink",
               "inter-node link": "nic:0", "cpu update": "cpu:0"}
"""The resources reported, by the capacity that stands for them (rank 0's where per rank)."""
_PER_RANK = {"gpu compute": "gpu", "h2d per GPU": "h2d", "d2h per GPU": "d2h", "cpu update": "cpu"}


def _demands(spec: StepSpec, sim: Simulation, step: int) -> dict[str, float]:
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


def _analyse(spec: StepSpec, sim: Simulation, t0: float, t1: float, *, last_step: int,
             device: str) -> StepPrediction:
    step = t1 - t0
    tasks = sim.tasks

    def on(lane: str, kinds=None) -> list[tuple[float, float]]:
        return [(t.start, t.end) for t in tasks
                if lane in t.lanes and (kinds is None or t.kind in kinds) and t.end > t.start]

    gpu_busy = on("gpu:0")
    idle = subtract([(t0, t1)], gpu_busy)
    exposed, left = {}, idle
    lanes0 = ("dstream:0", "ostream:0", "rstream:0", "uthread:0", "dthread:0", "gstream:0")
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

    demand = _demands(spec, sim, last_step)
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
    "other": lambda s: "more sequences per step (fewer step edges per token)",
}
