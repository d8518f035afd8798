"""SlideDP as a TrainBackend: the streamed step over the shared host state.

Three threads per rank:
  compute (the caller)  forward/backward block by block through the GPU window;
  delivery              version gate -> host->GPU copy (+ all-gather) into a free buffer, ahead
                        of use (one job per planned delivery, in use order);
  update                gradient returns (reduce + copy home, in the order backward hands them
                        over), then CPU AdamW on the rank's shard, chunk by chunk, one unit at a
                        time in the order slidedp/update_order.py picks; overlapped with backward
                        of earlier blocks and with the next step's forward; with
                        slidedp.embedding_update != "host" the embedding's AdamW, and with
                        slidedp.gpu_state_blocks the first blocks', is issued on the GPU instead
                        (slidedp/gpu_update.py), ahead of any host update.
Handshakes are futures carrying CUDA events, so waits happen on the device wherever possible.
The plan of a micro-batch (slidedp/schedule.py) is plain data; the futures of its uses live here.
Each block runs under its activation policy (slidedp/activations/: keep, recompute, segment
masks, op-level saves, offload to host), an object the compute thread calls.
Each step reports its bytes moved and where the threads' time went (`host_*_s`: version-gate
waits, delivery issue, gradient returns, updates, clipped updates, the compute thread's waits for
deliveries), `update_wait_s` (what the step waited for its returns after its GPU compute) and
`update_tail_s` (how long after a step's GPU compute its last update ended, reported when known).

train_step returns once the step's gradients are home and its norm is known; the updates go on
while the next step starts, whose deliveries wait at the version gates for their own unit's
update only (docs/DESIGN.md §5.6). Where each returned gradient waits for its update (`Hold`):
with one micro-batch it is BF16 as reduced, so it waits as BF16 (the shadow, whose unit is not
read again before its update; without a shadow the BF16 gradient buffer when updates are deferred,
or the GPU); accumulated micro-batches are summed in the FP32 buffer.
A step that fails on the compute thread (out of memory, a bad batch, Ctrl-C) first fails the jobs
waiting on it, so the error reaches the caller and the process can exit.

Non-finite guard (training.nonfinite != "off"): whether a step's loss and gradient are finite is
known only from the global norm, after backward, so with the guard on every update waits for it
as clipped ones do (the gradients wait on the host, in the shadow or +2 B/param without one, and
the updates overlap the next step's forward instead of this step's backward; the cost is in
docs/PERFORMANCE.md). A step whose global norm or loss is not
finite updates nothing: it only restores the shadow that held its gradients and opens its version
gates. With the guard off and no clipping, updates run during backward, unit by unit, as soon as
each gradient is home, and what backward leaves over runs in the next step's order.
When every unit's update runs on the GPU (`_norm_on_device`), the norm, the clipping coefficient
and the guard's test are taken there too, and the updates are queued behind backward before the
host reads the norm: fused AdamW scales each gradient and skips a non-finite step on the device.
"""

import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from models.kernels import resolve_kernels
from protocols.backend import Batch, StepResult
from protocols.bounds import check_field
from protocols.model_spec import ModelArgs, spec_of
from protocols.reconfigure import Knobs
from slidedp import affinity, cpu_adam
from slidedp import speculative as speculative_state
from slidedp.activations import (ActivationPolicy, BlockCost, BlockSegments, Offloader,
                                 WeightRefs, block_input, block_policies, describe_costs,
                                 measure_costs, offload_bytes)
from slidedp.config import EmbeddingUpdate, SlideDPConfig
from slidedp.delivery import Delivery
from slidedp.gpu_update import (PREFETCH_AT_BLOCK, STATE_REGIONS, GpuUpdate, GradScale,
                                check_gpu_updates, device_clip, gpu_updated_units)
from slidedp.host_state import (Hold, HostStatePlan, SharedHostState, StepAborted,
                                available_host_bytes, host_state_bytes, updates_deferred)
from slidedp.layout import StateLayout, Unit, chunk_elems
from slidedp.nodes import Nodes, ReplicaCheck, add_other_nodes_loss
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.save_gate import SaveGate
from slidedp.schedule import Use, plan_micro_batch
from slidedp.speculative import check_speculative
from slidedp.state_file import load_shards, read_master, save_shards
from slidedp.streams import Streams
from slidedp.traffic import Traffic
from slidedp.update import AdamHyper, GradientReturn, HostOptimizer, Returned
from slidedp.update_order import UPDATE_ORDERS, UpdateQueue


PARALLEL_INIT_PARAMS = 1_000_000_000


class _Laps:
    """Wall seconds of the build's phases (SlideDPBackend.build_s), each from the end of the one
    before: where a start of a minute goes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._last = now - self._last, now


class _UpdateTail:
    """When the last update of a step ended, against the end of the step's GPU compute."""

    def __init__(self, units: int):
        self.left = units  # updates still to end (the update thread counts them down)
        self.compute_end: float | None = None
        self.end: float | None = None

    def unit_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.end = time.perf_counter()


class SlideDPBackend:
    """Host-resident layer streaming with synchronous data-parallel semantics."""

    def __init__(self, job_config, model_args: ModelArgs, *, device: torch.device, dp_rank: int,
                 dp_world: int):
        tr, opt = job_config.training, job_config.optimizer
        lap = _Laps()
        self.build_s = lap.seconds
        # The runtime style (slidedp/peer_styles.py) sets its own routes and shadow.
        self.style = RUNTIME_STYLES[job_config.slidedp.runtime]
        cfg = self.style.configure(job_config.slidedp)
        self.cfg, self.args, self.device = cfg, model_args, device
        self.spec = spec_of(model_args)
        # The same kernels as every other mode, for the blocks run on streamed weights.
        kernels = self.kernels = resolve_kernels(job_config.model.kernels,
                                                 attention=job_config.model.attention,
                                                 device_type=device.type)
        # Several nodes (slidedp/nodes.py): each shards its own host state over its own ranks.
        self.nodes = Nodes.discover(rank=dp_rank, world=dp_world)
        self.nodes.check_same(_node_fields(job_config, model_args))
        self.leader = dp_rank == 0  # prints the start-up report
        self.rank, self.world = self.nodes.local_rank, self.nodes.local_world
        self.max_norm, self.loss_chunk = tr.max_norm, tr.loss_chunk_tokens
        self.guard = tr.nonfinite != "off"
        self.deferred = updates_deferred(max_norm=tr.max_norm, nonfinite=tr.nonfinite,
                                         reduction=cfg.reduction)
        self.layout = StateLayout(model_args, world=self.world, sole_owner=self.style.sole_owner)
        self.local_world = self.world
        check_gpu_updates(cfg, grad_accum_steps=tr.grad_accum_steps, n_layers=model_args.n_layers,
                          world=self.world)
        check_speculative(cfg, grad_accum_steps=tr.grad_accum_steps, n_layers=model_args.n_layers)
        needs = dict(grad_accum_steps=tr.grad_accum_steps, max_norm=tr.max_norm,
                     nonfinite=tr.nonfinite)
        plan = HostStatePlan.for_run(cfg, **needs)
        # Whether turning the shadow off saves host memory (not when a deferred step's gradients
        # would then need a buffer of the same size).
        self._shadow_off_saves = host_state_bytes(self.layout, plan) > host_state_bytes(
            self.layout, HostStatePlan.for_run(replace(cfg, bf16_shadow=False), **needs))
        self._check_host_memory(plan, offload_pool=None)
        # The policies' costs, measured on one block before anything big is allocated, size the
        # activation offload pool of the micro-batch the run is configured for.
        self.activation_costs: dict[ActivationPolicy, BlockCost] = {}
        self._micro_shape = (tr.local_batch_size, tr.seq_len)  # what the pool is sized for
        self._set_policies(block_policies(model_args.n_layers, default=cfg.activation,
                                          blocks=cfg.activation_blocks,
                                          keep_blocks=cfg.keep_blocks))
        self._check_host_memory(plan, offload_pool=self._offload_pool_bytes(*self._micro_shape))
        lap("checks and activation costs")

        distributed = dp_world > 1
        self.host_group = self.nodes.local_group(backend="gloo") if distributed else None
        self.state = SharedHostState(self.layout, plan, rank=self.rank, world=self.world,
                                     share=self._share, barrier=self._barrier,
                                     pin=device.type == "cuda", label=self.nodes.label)
        lap("host state")
        self._init_weights(hf_dir=job_config.model.hf_dir, seed=tr.seed)
        self._barrier()
        lap("weights")

        # Separate communicators: delivery and reduction run in their own threads, so each needs
        # collectives that are ordered only among themselves.
        self._gather_group = self.nodes.local_group() if distributed else None
        self._reduce_group = self.nodes.local_group() if distributed else None
        # Across nodes: each local rank's shard (the update thread), the totals and checksums
        # (this thread, on the host).
        self._cross_group = self.nodes.cross_group()
        self._cross_host = self.nodes.cross_group(backend="gloo")
        self.replicas = ReplicaCheck(self.nodes, every=cfg.replica_check_every,
                                     cross=self._cross_host, local=self.host_group)
        # Create each communicator now, from one thread, rather than lazily inside two worker
        # threads at once.
        for group in (self._gather_group, self._reduce_group, self._cross_group):
            if group is not None:
                dist.all_reduce(torch.zeros(1, device=device), group=group)
        self.chunk = chunk_elems(cfg.chunk_mib)
        self.streams = Streams(device)
        self.traffic = Traffic()
        threads = cfg.cpu_threads or self._default_threads()
        self.optimizer = HostOptimizer(self.state, AdamHyper(beta1=opt.beta1, beta2=opt.beta2,
                                                             eps=opt.eps,
                                                             weight_decay=opt.weight_decay),
                                       threads=threads)
        self._accum_steps = tr.grad_accum_steps
        self._pending: list[Future] = []
        self.gpu_updates: dict[int, GpuUpdate] = {}  # by unit index
        self._set_gpu_updates(cfg.embedding_update)
        lap("groups and GPU updates")
        self._prefetch_block = min(PREFETCH_AT_BLOCK, model_args.n_layers - 1)
        self._set_routes(delivery=cfg.delivery, reduction=cfg.reduction, chunk_mib=None)

        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.buffers = [torch.empty(self.layout.block_padded, **bf16) for _ in range(cfg.window_slots)]
        self.buffers.append(torch.empty(self.layout.embed.padded, **bf16))
        self.buffers.append(torch.empty(self.layout.head.padded, **bf16))
        with torch.device("meta"):
            self.segments = BlockSegments(self.spec.block_cls(model_args, kernels))
        self.head_loss = self.spec.head_loss(model_args, kernels)
        self._unit_source: dict[int, torch.Tensor] = {}  # what each unit's compute reads now
        self.weight_refs = WeightRefs(self.buffers, self._unit_source.__getitem__)
        self.offloader = Offloader(self.streams, self.traffic)
        self._ensure_offload_pool(*self._micro_shape, checked=True)
        lap("routes, window and offload pool")

        self._deliverer = ThreadPoolExecutor(1, thread_name_prefix="slidedp-deliver",
                                             initializer=self.streams.bind_thread)
        self._updater = ThreadPoolExecutor(1, thread_name_prefix="slidedp-update",
                                           initializer=self.streams.bind_thread)
        self._pinned = cfg.pin_threads
        if self._pinned:
            self._pin_threads(threads)
        # A failed job stops every wait of this rank (version gates included), so nothing hangs.
        self._queue = UpdateQueue(self._updater, UPDATE_ORDERS[cfg.update_order],
                                  on_failure=self.state.aborted.set)
        self._tails: list[_UpdateTail] = []  # steps whose updates have not all been reported
        # The current step's gradient returns, and the last one of each unit (by index).
        self._returns: list[Future] = []
        self._returned: dict[int, Future] = {}
        self._speculated: dict[int, Future] = {}  # this step's speculative updates, by unit
        self._last_release: dict[int, Future | None] = {b: None for b in range(len(self.buffers))}
        self._resident: dict[int, int] = {}
        # The current micro-batch's runtime state, by use: resolved by the compute thread with the
        # event after the use's last kernel; by the delivery thread with the arrival event.
        self._released: list[Future] = []
        self._delivered: list[Future | None] = []
        self._normsq = 0.0
        self._host_times: defaultdict[str, float] = defaultdict(float)  # running totals
        self._host_reported: dict[str, float] = {}  # the totals at the last step's report
        self._token = 0
        self._save_gate = SaveGate()
        self.steps_done = 0  # steps taken, skipped ones included: the version of the state
        self.adam_steps = 0  # updates applied: Adam's step count (bias correction)

    # ---- set-up -------------------------------------------------------------------------------

    def reconfigure(self, knobs: Knobs) -> None:
        """Apply `knobs` between steps (protocols/reconfigure.py): the routes and chunk first,
        then the slots, the activation policies, the embedding update (checked against the
        routes now in force), the update order and the CPU Adam threads. Numbers are held to
        their [slidedp] fields' bounds, as the config's are."""
        for name in ("chunk_mib", "window_slots", "keep_blocks", "cpu_threads"):
            if (value := getattr(knobs, name)) is not None:
                check_field(SlideDPConfig, name, value, key=f"slidedp.{name}")
        if (knobs.delivery, knobs.reduction, knobs.chunk_mib) != (None, None, None):
            self._set_routes(delivery=knobs.delivery or self.cfg.delivery,
                             reduction=knobs.reduction or self.cfg.reduction,
                             chunk_mib=knobs.chunk_mib)
        if knobs.window_slots is not None and knobs.window_slots != self.cfg.window_slots:
            self._set_window_slots(knobs.window_slots)
        if knobs.activation is not None:
            self._set_policies(block_policies(self.args.n_layers, default=knobs.activation,
                                              blocks=knobs.activation_blocks,
                                              keep_blocks=knobs.keep_blocks))
        if knobs.embedding_update is not None:
            self._set_gpu_updates(knobs.embedding_update)
        if knobs.update_order is not None:
            self._queue.order = UPDATE_ORDERS[knobs.update_order]
        if knobs.cpu_threads is not None:
            self._set_cpu_threads(knobs.cpu_threads)

    def _set_routes(self, *, delivery: str, reduction: str, chunk_mib: float | None) -> None:
        """The parameter and gradient routes; the host state is untouched (the CPU route needs
        its staging region, allocated when slidedp.reduction = "cpu"); `chunk_mib` changes the
        chunk of the copy and update pipelines as well. A peer runtime style runs its own routes
        only."""
        self.style.check_routes(delivery, reduction)
        self.nodes.check_reduction(reduction)
        check_gpu_updates(replace(self.cfg, delivery=delivery, reduction=reduction),
                          grad_accum_steps=self._accum_steps, n_layers=self.args.n_layers,
                          world=self.world)
        if reduction == "cpu" and not self.state.plan.cpu_staging:
            raise ValueError("reduction='cpu' needs the host staging region: start with "
                             "slidedp.reduction = 'cpu'")
        # The route has a place for a step's gradients.
        self.state.plan.hold(n_micro=1, reduction=reduction, deferred=self.deferred)
        self._drain()
        if chunk_mib is not None:
            self.chunk = chunk_elems(chunk_mib)
        self.cfg = replace(self.cfg, delivery=delivery, reduction=reduction,
                           chunk_mib=self.cfg.chunk_mib if chunk_mib is None else chunk_mib)
        self.delivery = Delivery(self.state, self.streams, route=delivery, rank=self.rank,
                                 world=self.world, group=self._gather_group,
                                 chunk_elems=self.chunk, traffic=self.traffic)
        self.grad_return = GradientReturn(self.state, self.streams, route=reduction,
                                          rank=self.rank, world=self.world,
                                          group=self._reduce_group, cross=self._cross_group,
                                          chunk_elems=self.chunk,
                                          traffic=self.traffic,
                                          max_unit=max(u.padded for u in self.layout.units),
                                          threads=self.optimizer.threads,
                                          barrier_per_chunk=self.style.barrier_per_chunk)

    def _set_gpu_updates(self, where: EmbeddingUpdate) -> None:
        """slidedp.embedding_update, with slidedp.gpu_state_blocks; pending updates finish first,
        where they were to run, and resident state goes home (the new ones fetch it)."""
        cfg = replace(self.cfg, embedding_update=where)
        check_gpu_updates(cfg, grad_accum_steps=self._accum_steps, n_layers=self.args.n_layers,
                          world=self.world)
        self._drain()
        self.cfg = cfg
        units = gpu_updated_units(cfg, self.args.n_layers)
        self.state.pin_units(sorted(units), STATE_REGIONS)
        self.gpu_updates = {
            index: GpuUpdate(self.state, self.streams, self.optimizer.hyper,
                             self.layout.units[index], rank=self.rank, world=self.world,
                             traffic=self.traffic, resident=resident)
            for index, resident in units.items()}

    def _set_cpu_threads(self, threads: int) -> None:
        """slidedp.cpu_threads (0: this rank's share of the cores). Pending updates finish first,
        with the old count; the count changes timing only (the CPU Adam's result does not depend
        on it). A new update order, in reconfigure, needs no drain: it changes timing only, so
        the updates still queued simply follow it."""
        self._drain()
        self.optimizer.threads = self.grad_return.threads = threads or self._default_threads()
        if self._pinned:
            self._pin_threads(self.optimizer.threads)

    def _pin_threads(self, update_threads: int) -> None:
        """slidedp.pin_threads: this rank's threads on its share of the cores (slidedp/affinity.py),
        each runtime thread pinned from inside itself."""
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.local_world))
        where = affinity.placement(affinity.rank_cores(local_rank, self.local_world),
                                   update_threads=update_threads)
        self._deliverer.submit(affinity.pin_this_thread, where.deliver).result()
        self._updater.submit(affinity.pin_this_thread, where.update).result()
        self._updater.submit(cpu_adam.pin_helpers, list(where.helpers)).result()
        affinity.pin_this_thread(where.compute)

    def _default_threads(self) -> int:
        # A sole owner (rank 0) runs every update: the host's cores are its alone.
        return cpu_adam.default_num_threads(
            local_world=1 if self.style.sole_owner else self.local_world)

    def _set_window_slots(self, slots: int) -> None:
        """slidedp.window_slots: the slots are allocated anew and the next step delivers every
        block."""
        self._drain()
        Streams.synchronize(self.streams.record())  # no kernel or copy uses a slot any more
        old = self.cfg.window_slots
        del self.buffers[:old]  # the same list: the deliveries index it
        self.buffers[:0] = [torch.empty(self.layout.block_padded, dtype=torch.bfloat16,
                                        device=self.device) for _ in range(slots)]
        self.cfg = replace(self.cfg, window_slots=slots)
        # The saved-tensor hooks know the buffers by address: the new ones too.
        self.weight_refs = WeightRefs(self.buffers, self._unit_source.__getitem__)
        self._last_release = {b: None for b in range(len(self.buffers))}
        self._resident = {}

    def reset_optimizer(self) -> None:
        """The optimizer state of a fresh start, weights untouched: this rank's Adam moments
        zero, Adam's step count and the step counter 0 (AutoPolicy measures with lr = 0, which
        leaves the weights as they were but moves the moments)."""
        self._drain()
        self._barrier()  # no peer's delivery reads our version counters any more
        for unit in self.layout.units:
            for region in self.state.plan.state_regions()[1:]:  # the moments (and their scales)
                self.state.shard_view(region, unit).zero_()
            self.state.version[unit.index, self.rank] = 0
        for g in self.gpu_updates.values():
            g.invalidate()
        self.steps_done = self.adam_steps = 0
        self._barrier()

    def _set_policies(self, policies: list[ActivationPolicy]) -> None:
        """The per-block activation policies; between steps they can change freely (only the
        compute thread reads them, and a step's saved activations are gone by its end). A larger
        offload pool, if the new policies need one, is allocated before the next step."""
        new = set(policies) - self.activation_costs.keys()
        if new:
            self.activation_costs.update(measure_costs(new, self.args, self.kernels,
                                                       device=self.device,
                                                       seq_len=self._micro_shape[1]))
        self.policies = policies
        if self.leader:
            print(describe_costs(policies, self.activation_costs, *self._micro_shape), flush=True)

    def _offload_pool_bytes(self, batch: int, seq: int) -> int:
        return offload_bytes(self.policies, self.activation_costs, batch, seq)

    def _ensure_offload_pool(self, batch: int, seq: int, *, checked: bool = False) -> None:
        """Grow this rank's offload pool to what the policies need for micro-batches of `batch`
        x `seq` tokens (between steps: nothing is in flight); `checked`: the host-memory check
        counted it."""
        need = self._offload_pool_bytes(batch, seq)
        grow = need - self.offloader.pool.nbytes
        if grow <= 0:
            return
        if not checked:
            have = available_host_bytes()
            if self.leader:
                print(f"[slidedp] activation offload pool grows to {need / 2**30:.2f} GiB per "
                      f"rank for {batch} x {seq} tokens per micro-batch", flush=True)
            if grow * self.local_world > have and self.cfg.check_host_memory:
                raise MemoryError(f"SlideDP: the activation offload pool needs "
                                  f"{grow * self.local_world / 2**30:.2f} GiB more host memory, "
                                  f"{have / 2**30:.2f} GiB is available (offload less)")
        self.offloader.pool.allocate(need)

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.host_group)

    def _share(self, value: str) -> str:
        box = [value]
        if self.world > 1:
            dist.broadcast_object_list(box, group_src=0, group=self.host_group)
        return box[0]

    def _check_host_memory(self, plan: HostStatePlan, *, offload_pool: int | None) -> None:
        """Refuse to start without host memory for the state and this rank's offload pool
        (None: the state alone, checked before the policies are measured on one block), and
        report both."""
        state = host_state_bytes(self.layout, plan)
        need = state + (offload_pool or 0) * self.local_world
        have = available_host_bytes()
        if self.leader and offload_pool is not None:
            n = self.args.num_params()
            pool = (f" + activation offload pool {offload_pool / 2**30:.2f} GiB x "
                    f"{self.local_world} ranks" if offload_pool else "")
            print(f"[slidedp] host state: {state / 2**30:.2f} GiB shared for {n / 1e6:,.1f}M "
                  f"params ({state / n:.1f} B/param: {plan.describe()}){pool}; "
                  f"available {have / 2**30:.2f} GiB", flush=True)
        if need > have and self.cfg.check_host_memory:
            shadow = "turn off slidedp.bf16_shadow, " if self._shadow_off_saves else ""
            raise MemoryError(f"SlideDP needs {need / 2**30:.2f} GiB of host memory but only "
                              f"{have / 2**30:.2f} GiB is available (offload fewer activations, "
                              f"{shadow}use a smaller model, or set slidedp.check_host_memory = "
                              f"false on machines whose memory grows on demand)")

    def _master_view(self, name: str) -> torch.Tensor:
        unit, p = self.layout.by_name[name]
        start = unit.host_offset + p.offset
        return self.state.master[start:start + p.numel].view(p.shape)

    @torch.no_grad()
    def _init_weights(self, *, hf_dir: str, seed: int) -> None:
        """Fill the shared master (and shadow). Checkpoints are read by rank 0. Random init of
        models up to PARALLEL_INIT_PARAMS reproduces the model's init_weights after
        torch.manual_seed(seed) draw for draw (so `single` and `slidedp` start equal); bigger ones
        are drawn by all ranks in parallel, one generator per unit (seed, unit) — minutes saved
        at 8B+, same distribution, different values."""
        mine: list[Unit] = []
        if hf_dir:
            if self.rank == 0:
                from models.hf_checkpoint import load_hf_into

                expected = {name: p.shape for name, (_, p) in self.layout.by_name.items()}
                load_hf_into(lambda name, t: self._master_view(name).copy_(t), hf_dir, expected)
                mine = self.layout.units
        elif self.args.num_params() <= PARALLEL_INIT_PARAMS:
            if self.rank == 0:
                torch.manual_seed(seed)
                for name in self.layout.by_name:
                    self._init_parameter(name)
                mine = self.layout.units
        else:
            mine = self.layout.units[self.rank::self.world]

            def draw(unit: Unit) -> None:
                gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
                for p in unit.params:
                    self._init_parameter(p.name, generator=gen)

            # torch's CPU normal_ draws on one core; one generator per unit makes the units
            # independent, so this rank's share of the cores draws them at once, same values.
            with ThreadPoolExecutor(cpu_adam.default_num_threads(local_world=self.local_world),
                                    thread_name_prefix="slidedp-init") as pool:
                list(pool.map(draw, mine))
        if self.state.plan.bf16_shadow:
            for unit in mine:
                self.state.unit_view("shadow", unit.index).copy_(self.state.unit_view("master", unit.index))

    def _init_parameter(self, name: str, generator: torch.Generator | None = None) -> None:
        """Draws in FP32, as `single` does, then stores (a BF16 master: rounded)."""
        master = self._master_view(name)
        drawn = master if master.dtype == torch.float32 else torch.empty(master.shape)
        self.spec.init_parameter(name, drawn, generator=generator)
        if drawn is not master:
            master.copy_(drawn)

    # ---- the step -----------------------------------------------------------------------------

    def _leaves(self, unit: Unit, *, grad: bool) -> dict[str, torch.Tensor]:
        buf = self._unit_source[unit.index]
        return {p.local_name: buf[p.offset:p.offset + p.numel].view(p.shape).detach().requires_grad_(grad)
                for p in unit.params}

    def _deliver_job(self, use: Use, after: Future | None, version: int):
        if after is not None:
            self.streams.wait(after.result(), self.delivery.stream)
        unit = self.layout.units[use.unit]
        with self._timed("gate_wait_s"):
            self.delivery.wait_version(unit, version)
        # A resident unit's shard is on the GPU once its state is (read after the gate: the
        # version's update is issued by then).
        g = self.gpu_updates.get(unit.index)
        with self._timed("deliver_s"):
            return self.delivery.deliver(unit, self.buffers[use.buffer],
                                         g.delivery_source() if g is not None else None)

    def _submit_deliveries(self, uses: list[Use]) -> None:
        self._released, self._delivered = [], []
        for use in uses:
            self._delivered.append(self._deliverer.submit(
                self._deliver_job, use, self._last_release[use.buffer], self.steps_done)
                if use.deliver else None)
            self._released.append(Future())
            self._last_release[use.buffer] = self._released[-1]

    def _submit_grad(self, unit: Unit, leaves: dict[str, torch.Tensor], *, micro: int,
                     n_micro: int, lr: float, hold: Hold, tail: _UpdateTail) -> None:
        flat = torch.empty(unit.padded, dtype=torch.bfloat16, device=self.device)
        grads = [(leaves[p.local_name].grad if leaves[p.local_name].grad is not None
                  else torch.zeros(p.shape, dtype=torch.bfloat16, device=self.device)).reshape(-1)
                 for p in unit.params]
        torch.cat(grads, out=flat[:unit.numel])
        flat[unit.numel:].zero_()
        ready = self.streams.record()
        step = dict(lr=lr, adam_step=self.adam_steps + 1, version=self.steps_done + 1, tail=tail)
        job = self._gpu_return_job if self._updated_on_gpu(unit) else self._return_job
        returned = self._queue.add_return(partial(
            job, self.grad_return, unit, flat, ready, self._token, micro=micro,
            n_micro=n_micro, hold=hold, **step))
        self._returns.append(returned)
        if micro < n_micro - 1:
            return
        self._returned[unit.index] = returned
        # Runnable once the gradient is home (the GPU's update runs in its return job);
        # speculative ones too, their gates left closed until the step's norm is known.
        speculate = self.state.plan.redo
        if (not self.deferred or speculate) and hold != "none" and not self._updated_on_gpu(unit):
            done = self._queue_update(unit, hold, returned, coef=1.0, skip=False,
                                      speculative=speculate, **step)
            if speculate:
                self._speculated[unit.index] = done

    def _queue_update(self, unit: Unit, hold: Hold, returned: Future, **kw) -> Future:
        job = partial(self._update_job, self.grad_return, unit, hold, returned, **kw)
        done = self._queue.add_update(unit.index, job, after=returned, first=self._updated_on_gpu(unit))
        self._pending.append(done)
        return done

    def _return_job(self, route: GradientReturn, unit: Unit, flat: torch.Tensor, ready,
                    token: int, *, micro: int, n_micro: int, hold: Hold, lr: float,
                    adam_step: int, version: int, tail: _UpdateTail):
        """One micro-batch's gradient of the unit comes home and waits where `hold` says (with
        "none" it is applied as it arrives); returns what the unit's update needs."""
        last = micro == n_micro - 1
        with self._timed("grad_job_s"):
            # One micro-batch: the route's gradient is the step's, so the route takes its norm
            # (on the GPU, or inside the host sum). Accumulated: the last accumulation pass.
            returned = route.start(unit, flat, ready, token, norm=n_micro == 1)
            if hold in ("shadow", "grad_bf16"):
                lo, hi = unit.shard(self.rank, self.world)
                return route.copy_home(returned, self.state.unit_view(hold, unit.index, lo, hi))
            if hold == "grad_accum":
                for lo, hi, g in route.chunks(returned):
                    with self._timed("accumulate_s"):
                        self._normsq += cpu_adam.grad_accumulate(
                            self.state.grad_accum[unit.host_offset + lo:unit.host_offset + hi], g,
                            assign=micro == 0, want_sumsq=last and n_micro > 1,
                            num_threads=self.optimizer.threads)
                return None
            if hold == "staging":
                for _ in route.chunks(returned, release=False):
                    pass  # the sum, for the norm; the copies stay until the update sums again
                return returned
            if hold in ("device", "shared_accum"):
                return returned
        self._update(unit, route.chunks(returned), coef=1.0, lr=lr, adam_step=adam_step,
                     version=version, tail=tail)
        return None

    def _gpu_return_job(self, route: GradientReturn, unit: Unit, flat: torch.Tensor, ready,
                        token: int, *, lr: float, adam_step: int, version: int,
                        tail: _UpdateTail, **_) -> Returned:
        """The return of a unit the GPU updates (one micro-batch): reduced there, never copied
        home, and updated at once, ahead of any host update left over (the next forward needs
        it first), or, deferred, by its update job after the step's norm."""
        with self._timed("grad_job_s"):
            returned = route.start(unit, flat, ready, token, norm=True, home=False)
        if not self.deferred:
            self._update_on_gpu(route, returned, coef=1.0, lr=lr, adam_step=adam_step,
                                version=version, tail=tail)
        return returned

    def _update_job(self, route: GradientReturn, unit: Unit, hold: Hold, returned: Future, *,
                    coef: float | GradScale, skip: bool, lr: float, adam_step: int,
                    version: int, tail: _UpdateTail, speculative: bool = False) -> None:
        """The unit's update from where its gradient waited (scaled by `coef`, a GradScale for
        a unit updated on the GPU only); a skipped step's only restores what held the gradient
        and opens the version gate. A speculative one keeps the state it starts from and leaves
        the gate to `_settle_job`."""
        held = returned.result()
        if speculative:
            speculative_state.keep(self.state, unit)
            self._update(unit, self._held_grads(unit, hold, route, held), coef=1.0, lr=lr,
                         adam_step=adam_step, version=version, tail=tail, open_gate=False)
            return
        if self._updated_on_gpu(unit):
            if skip:
                self.gpu_updates[unit.index].drop()
                self._set_version(unit, version, tail)
            else:
                self._update_on_gpu(route, held, coef=coef, lr=lr, adam_step=adam_step,
                                    version=version, tail=tail)
            return
        if not skip:
            self._update(unit, self._held_grads(unit, hold, route, held), coef=coef, lr=lr,
                         adam_step=adam_step, version=version, tail=tail)
            return
        if hold == "shadow":  # it holds the gradient: the weights come back from the master
            Streams.synchronize(held)
            self._shadow_from_master(unit)
        elif hold == "staging":
            route.release(held)
        elif hold == "shared_accum":
            for _ in route.chunks(held):
                pass  # zeroes the sum for the next step
        self._set_version(unit, version, tail)

    def _held_grads(self, unit: Unit, hold: Hold, route: GradientReturn,
                    held) -> Iterable[tuple[int, int, torch.Tensor]]:
        """The unit's summed gradient shard where it waited, in unit-local chunks."""
        if hold in ("device", "staging", "shared_accum"):
            return route.chunks(held)  # the copy home, the host sum again, or the shared sum
        Streams.synchronize(held)  # a host region: the copy home has landed
        lo, hi = unit.shard(self.rank, self.world)
        region, base = self.state.regions[hold], unit.host_offset
        return ((a, min(a + self.chunk, hi), region[base + a:base + min(a + self.chunk, hi)])
                for a in range(lo, hi, self.chunk))

    def _update(self, unit: Unit, grads: Iterable[tuple[int, int, torch.Tensor]], *,
                coef: float, lr: float, adam_step: int, version: int,
                tail: _UpdateTail, open_gate: bool = True) -> None:
        """AdamW on this rank's shard of the unit, chunk by chunk, then its version gate."""
        self._wait_save(unit, version)
        with self._timed("clipped_update_s" if self.deferred else "update_s"):
            for lo, hi, g in grads:
                self.optimizer.update(unit.host_offset + lo, unit.host_offset + hi, g,
                                      step=adam_step, lr=lr, grad_scale=coef)
        if open_gate:
            self._set_version(unit, version, tail)

    def _settle_job(self, route: GradientReturn, unit: Unit, hold: Hold, returned: Future, *,
                    coef: float, skip: bool, lr: float, adam_step: int, version: int,
                    tail: _UpdateTail) -> None:
        """After the unit's speculative update, once the step's norm is known: it stands
        (coefficient 1, a finite step), or the state is restored and the update redone scaled,
        or not at all for a skipped step (the shadow rounded again from the restored master);
        then the version gate opens."""
        if coef == 1.0 and not skip:
            self._set_version(unit, version, tail)
            return
        with self._timed("redo_s"):
            speculative_state.restore(self.state, unit)
        if not skip:
            self._update(unit, self._held_grads(unit, hold, route, returned.result()), coef=coef,
                         lr=lr, adam_step=adam_step, version=version, tail=tail)
            return
        if self.state.plan.bf16_shadow:
            self._shadow_from_master(unit)
        self._set_version(unit, version, tail)

    def _shadow_from_master(self, unit: Unit) -> None:
        """This rank's shard of the unit's BF16 shadow rounded again from its master."""
        self.state.shard_view("shadow", unit).copy_(self.state.shard_view("master", unit))

    def _updated_on_gpu(self, unit: Unit) -> bool:
        return unit.index in self.gpu_updates

    @property
    def _norm_on_device(self) -> bool:
        """The step's updates wait for its norm and every unit's runs on the GPU (one micro-batch,
        the gpu route): the norm, the clipping coefficient and the non-finite test are taken
        there too (gpu_update.device_clip)."""
        return self.deferred and len(self.gpu_updates) == len(self.layout.units)

    def _update_on_gpu(self, route: GradientReturn, returned: Returned, *,
                       coef: float | GradScale, lr: float, adam_step: int, version: int,
                       tail: _UpdateTail) -> None:
        """The unit's AdamW on the GPU (slidedp/gpu_update.py); its version gate opens once the
        delivery source is home (resident: once the update is issued)."""
        unit = returned.unit
        self._wait_save(unit, version)
        with self._timed("gpu_update_s"):
            self.gpu_updates[unit.index].update(returned.shard, self.streams.record(route.stream),
                                                scale=coef, lr=lr, step=adam_step)
        returned.shard = None
        self._set_version(unit, version, tail)

    def _set_version(self, unit: Unit, version: int, tail: _UpdateTail) -> None:
        self.state.version[unit.index, self.rank] = version
        tail.unit_done()

    def _wait_save(self, unit: Unit, version: int) -> None:
        """The background save must have written the unit before this update (`host_save_wait_s`:
        the time it held the update up)."""
        waited = self._save_gate.wait(unit.index, version, self.state.aborted)
        if waited:
            self._host_times["save_wait_s"] += waited

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        """Adds the block's wall time to the running total of `host_<key>` (each key has one
        thread)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._host_times[key] += time.perf_counter() - start

    def _wait_buffer(self, k: int, use: Use) -> None:
        if self._delivered[k] is not None:
            with self._timed("delivery_wait_s"):
                done, source = self._delivered[k].result()
            self.streams.wait(done)
            if source is not self.buffers[use.buffer]:  # a resident unit's own BF16 copy
                self.weight_refs.keep(source)
                if self.streams.is_cuda:  # an invalidate may drop it while compute reads it
                    source.record_stream(torch.cuda.current_stream(self.device))
            self._unit_source[use.unit] = source  # an undelivered use's unit is still there

    def _micro_batch(self, uses: list[Use], tokens: torch.Tensor, labels: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor], *, global_tokens: int, micro: int,
                     n_micro: int, lr: float, hold: Hold, tail: _UpdateTail) -> torch.Tensor:
        units = self.layout.units
        saved: dict[int, tuple] = {}
        grad_kw = dict(micro=micro, n_micro=n_micro, lr=lr, hold=hold, tail=tail)
        self.offloader.begin_micro_batch()
        # Set by the uses in their fixed order: embed fwd (h0, emb), head (loss, grad_h), ...
        # Graphs are held by their gradient edges, not by their output tensors, whose memory
        # the next block's policy decides about.
        h = h0 = emb = grad_h = loss = None
        for k, use in enumerate(uses):
            self._wait_buffer(k, use)
            if use.prefetch is not None:
                self.offloader.prefetch(use.prefetch)
            unit = units[use.unit]
            if unit.kind == "embed" and use.phase == "fwd":
                emb = self._leaves(unit, grad=True)
                h = self.spec.embed(emb, tokens)
                h0 = get_gradient_edge(h)
                h = h.detach()
            elif unit.kind == "embed":
                torch.autograd.backward(h0, grad_h)
                self._submit_grad(unit, emb, **grad_kw)
            elif unit.kind == "head":
                h_in = h.requires_grad_()
                head = self._leaves(unit, grad=True)
                loss = self.head_loss(head, emb, h_in, labels,
                                      chunk_tokens=self.loss_chunk) / global_tokens
                loss.backward()
                grad_h = h_in.grad
                self._submit_grad(unit, head, **grad_kw)
            elif use.phase == "fwd":
                h = self._block_forward(unit, use, h, rope, saved)
            else:
                if unit.index - 1 == self._prefetch_block and 0 in self.gpu_updates:
                    self.gpu_updates[0].prefetch()  # the embedding's state, for its update
                out, grad_in, leaves = saved.pop(unit.index)
                torch.autograd.backward(out, grad_h)
                (grad_h,) = grad_in
                self.offloader.release(unit.index)
                self._submit_grad(unit, leaves, **grad_kw)
            self._released[k].set_result(self.streams.record())
        return loss.detach()

    def _block_forward(self, unit: Unit, use: Use, h: torch.Tensor, rope,
                       saved: dict) -> torch.Tensor:
        """The block's forward under its policy; what backward needs goes into `saved`."""
        grad_in: list[torch.Tensor] = []  # the input's gradient, appended by backward
        leaves = self._leaves(unit, grad=True)
        with (self.offloader.forward_of(unit.index, use.offload) as offload,
              self.weight_refs.during_forward_of(unit.index, offload)):
            out = self.policies[unit.index - 1].forward(self.segments, block_input(h, grad_in),
                                                       leaves, rope)
        saved[unit.index] = (get_gradient_edge(out), grad_in, leaves)
        return out.detach()

    def train_step(self, micro_batches: list[Batch], *, lr: float, global_target_tokens: int) -> StepResult:
        if self.state.aborted.is_set():
            raise RuntimeError("SlideDP: an earlier step failed on this rank; its host state is "
                               "mid-update, so restart from the last checkpoint")
        # Refused before any work if the host state has no place for the step's gradients.
        hold = self.state.plan.hold(n_micro=len(micro_batches), reduction=self.grad_return.route,
                                    deferred=self.deferred)
        try:
            result = self._train_step(micro_batches, hold=hold, lr=lr,
                                      global_target_tokens=global_target_tokens)
        except BaseException as e:
            self._abort()
            cause = self._failed_job()
            if isinstance(e, StepAborted) and cause is not None:
                raise cause  # a job of the update thread failed and stopped the waits
            raise
        if self.replicas.due(self.steps_done):
            # Outside the failed-step path: the step is complete, and every rank finds a
            # divergence in the same collective, so the backend still closes (its groups joined).
            self.replicas.check([self.state.shard_view(region, unit) for unit in self.layout.units
                                 for region in self.state.plan.state_regions()],
                                step=self.steps_done)
        return result

    def _failed_job(self) -> BaseException | None:
        """The first error of an update-thread job, other than the stops it caused."""
        for fut in (*self._pending, *self._returns):
            if fut.done() and not isinstance(fut.exception(), (type(None), StepAborted)):
                return fut.exception()
        return None

    def _abort(self) -> None:
        """The step failed on the compute thread (out of memory, a bad batch, Ctrl-C). Its jobs
        would otherwise wait forever for buffer releases that will never come, or for counters,
        and keep the process from exiting: fail the releases and stop the counter waits. The
        offloaded activations and their host pool are freed now."""
        self.state.aborted.set()
        for g in self.gpu_updates.values():
            g.drop()
        for released in self._released:
            if not released.done():
                released.set_exception(StepAborted("SlideDP: the step using this buffer failed"))
        self.offloader.clear()

    def _train_step(self, micro_batches: list[Batch], *, hold: Hold, lr: float,
                    global_target_tokens: int) -> StepResult:
        self._reap()
        n_micro = len(micro_batches)
        rope = self.spec.rope_tables(self.args, micro_batches[0][0].shape[1], self.device)
        self._ensure_offload_pool(*micro_batches[0][0].shape)
        offload = [p.offload for p in self.policies]
        tail = _UpdateTail(len(self.layout.units))
        self._tails.append(tail)
        self._returns, self._returned, self._speculated = [], {}, {}
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro, (tokens, labels) in enumerate(micro_batches):
            self._token += 1
            uses, self._resident = plan_micro_batch(
                self.args.n_layers, self.cfg.window_slots,
                resident=self._resident if micro else {}, embed_head_resident=micro > 0,
                offload=offload)
            self._submit_deliveries(uses)
            loss += self._micro_batch(uses, tokens.to(self.device, non_blocking=True),
                                      labels.to(self.device, non_blocking=True), rope,
                                      global_tokens=global_target_tokens, micro=micro,
                                      n_micro=n_micro, lr=lr, hold=hold, tail=tail)
        step = dict(lr=lr, adam_step=self.adam_steps + 1, version=self.steps_done + 1, tail=tail)
        device_totals = None
        if self._norm_on_device:
            # Every update reads its gradient on the GPU: they are queued now, behind backward,
            # scaled and skipped there as the step's norm says, while the host waits below.
            for returned in self._returns:
                returned.result()  # every unit's norm is issued
            device_totals, scale = device_clip(
                self.grad_return.take_device_normsq(), loss, max_norm=self.max_norm,
                guard=self.guard, group=self._reduce_group, cross=self._cross_group,
                streams=self.streams)
            for unit in self.layout.units:
                self._queue_update(unit, hold, self._returned[unit.index], coef=scale,
                                   skip=False, **step)
        # What the step waits for after the GPUs finish its compute: its gradients coming home
        # (and on the cpu route without deferral their updates, which take the norm).
        Streams.synchronize(self.streams.record())
        tail.compute_end = t_compute = time.perf_counter()
        for returned in self._returns:
            returned.result()
        t_returned = time.perf_counter()
        if device_totals is not None:
            totals = device_totals.cpu()
        else:
            self._normsq += self.grad_return.take_normsq()
            totals = torch.tensor([self._normsq, float(loss)], dtype=torch.float64)
            self._normsq = 0.0
            if self.world > 1:
                dist.all_reduce(totals, group=self.host_group)
            add_other_nodes_loss(totals, self._cross_host)
        grad_norm, loss_sum = math.sqrt(totals[0].item()), totals[1].item() * global_target_tokens
        self.steps_done += 1
        # Global values: every rank takes the same decision.
        skipped = self.guard and not (math.isfinite(grad_norm) and math.isfinite(loss_sum))
        if not skipped:
            self.adam_steps += 1
        if self.deferred and device_totals is None:
            # Skipped: nothing is updated, the next step may read every unit.
            coef = min(1.0, self.max_norm / (grad_norm + 1e-6)) if self.max_norm > 0 else 1.0
            for unit in self.layout.units:
                if unit.index in self._speculated:
                    job = partial(self._settle_job, self.grad_return, unit, hold,
                                  self._returned[unit.index], coef=coef, skip=skipped, **step)
                    self._pending.append(self._queue.add_update(
                        unit.index, job, after=self._speculated[unit.index]))
                else:
                    self._queue_update(unit, hold, self._returned[unit.index], coef=coef,
                                       skip=skipped, **step)
        if self.style.update_after_backward:  # none overlaps the next step
            self._drain()
        extra = self.traffic.take()
        if self._speculated:  # how often speculation pays: 1 when this step's updates are redone
            extra["speculative_redo"] = float(coef != 1.0 or skipped)
        extra.update(update_wait_s=t_returned - t_compute, **self._finished_tail(),
                     **self._host_times_since_last_step())
        if self.replicas.due(self.steps_done):
            self._drain()  # the checksum reads this step's updates: they end first
        return StepResult(loss_sum=loss_sum, grad_norm=grad_norm, extra=extra, skipped=skipped)

    def _finished_tail(self) -> dict[str, float]:
        """`update_tail_s` of the latest step whose updates all ended since the last report
        (the previous step's, when its updates outlast it): from the end of its GPU compute to
        its last update."""
        done = [t for t in self._tails if t.end is not None]
        self._tails = [t for t in self._tails if t.end is None]
        return {"update_tail_s": max(0.0, done[-1].end - done[-1].compute_end)} if done else {}

    def _host_times_since_last_step(self) -> dict[str, float]:
        """`host_<key>` seconds since the previous step's report: updates that run after a
        step returns count in the next step instead of being lost."""
        totals = dict(self._host_times)
        since = {f"host_{key}": total - self._host_reported.get(key, 0.0)
                 for key, total in totals.items() if total > self._host_reported.get(key, 0.0)}
        self._host_reported = totals
        return since

    # ---- outside the step ---------------------------------------------------------------------

    def _reap(self) -> None:
        """Forget the updates that ended; one that failed since the last step fails this one."""
        for fut in self._pending:
            if fut.done():
                fut.result()
        self._pending = [fut for fut in self._pending if not fut.done()]

    def _drain(self) -> None:
        for fut in self._pending:
            fut.result()
        self._pending.clear()
        for g in self.gpu_updates.values():
            g.wait_home()

    def named_master_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._drain()
        self._barrier()  # every rank's shard of the last update is in place
        for name in self.layout.by_name:
            yield name, self._master_view(name)

    def snapshot_state(self, group) -> Callable[[str], None]:
        """Nothing is copied: the writer waits for the last step's pending updates, then writes
        this rank's shards (slidedp/state_file.py) unit by unit, in the order the next step
        updates them, and each unit's next update waits until the unit is written (SaveGate).
        Only this rank's shards are read, so the writer needs no peer (`group` is unused). Node 0
        alone writes: the other nodes' replicas are the same bytes (slidedp/nodes.py), and every
        node loads node 0's files on resume."""
        pending = list(self._pending)  # the last step's updates may still be running
        units = list(self.layout.units)
        if not self.deferred:  # the next step updates during backward: head first
            units.reverse()
        steps, adam_steps = self.steps_done, self.adam_steps
        self._save_gate.arm(steps, [u.index for u in units])

        def write(path: str) -> None:
            try:
                for fut in pending:
                    fut.result()
                for g in self.gpu_updates.values():
                    g.wait_home()
                if self.nodes.node == 0:
                    save_shards(self.state, path, steps_done=steps, adam_steps=adam_steps,
                                units=units,
                                unit_written=lambda u: self._save_gate.release(u.index))
            finally:
                self._save_gate.release_all()

        return write

    def saved_master_parameters(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        return read_master(self.layout, path)

    @torch.no_grad()
    def load_state(self, path: str) -> int:
        """Load this rank's shards, rebuild their BF16 shadow and open the version gates of the
        next step's deliveries; returns the step reached."""
        self._drain()
        steps, self.adam_steps = load_shards(self.state, path)
        for g in self.gpu_updates.values():
            g.invalidate()
        for unit in self.layout.units:
            if self.state.plan.bf16_shadow:
                self._shadow_from_master(unit)
            self.state.version[unit.index, self.rank] = steps
        self.steps_done = steps
        self._barrier()  # every rank's shards are in place before any delivery reads them
        return steps

    def close(self) -> None:
        try:
            if not self.state.aborted.is_set():  # after a failed step the jobs end in StepAborted
                self._drain()
        finally:
            self._deliverer.shutdown(wait=True, cancel_futures=True)
            self._updater.shutdown(wait=True, cancel_futures=True)
            if not self.state.aborted.is_set():  # a failed rank's peers may still be in one
                self._destroy_groups()
            self.offloader.clear()
            self.buffers.clear()
            self.state.close()

    def _destroy_groups(self) -> None:
        """End this backend's process groups once no thread of it can issue a collective. Left
        alive, they live as long as the backend (reference cycles: often until interpreter exit),
        and a gloo worker thread that drops a finished collective's tensors after the caller has
        dropped its own needs the GIL; during interpreter finalization that aborts the process
        ("terminate called without an active exception"). Destroyed here, each group joins its
        threads now (torch releases the GIL for it), every rank in the same order."""
        groups = [g for g in (self.host_group, self._gather_group, self._reduce_group,
                              self._cross_group, self._cross_host) if g is not None]
        self.host_group = self._gather_group = self._reduce_group = None
        self._cross_group = self._cross_host = self.replicas.cross = self.replicas.local = None
        self.delivery.group = self.grad_return.group = self.grad_return.cross = None
        for group in groups:
            dist.destroy_process_group(group)


def _node_fields(job_config, model_args: ModelArgs) -> dict[str, object]:
    """What every node must run alike (slidedp/nodes.py check_same), by `section.key`."""
    sections = {"model": model_args, "training": job_config.training,
                "optimizer": job_config.optimizer, "slidedp": job_config.slidedp}
    return {f"{name}.{key}": value for name, section in sections.items()
            for key, value in asdict(section).items()}


def build_slidedp_backend(job_config, model_args: ModelArgs, *, device: torch.device,
                          dp_rank: int, dp_world: int) -> SlideDPBackend:
    """The `parallelism.mode = "slidedp"` backend."""
    return SlideDPBackend(job_config, model_args, device=device, dp_rank=dp_rank, dp_world=dp_world)
