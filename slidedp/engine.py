"""SlideDP as a TrainBackend: the streamed step over the shared host state.

Three threads per rank:
  compute (the caller)  forward/backward block by block through the GPU window
                        (slidedp/block_runner.py);
  delivery              version gate -> host->GPU copy (+ all-gather) into a free buffer, ahead
                        of use (slidedp/block_runner.py, slidedp/routes/delivery.py);
  update                gradient returns, then the updates on the rank's shard
                        (slidedp/gradient_flow.py, slidedp/holds.py).
Each step reports its bytes moved and where the threads' time went (slidedp/step_metrics.py).

train_step returns once the step's gradients are home and its norm is known; the updates go on
while the next step starts, whose deliveries wait at the version gates for their own unit's
update only (docs/DESIGN.md §5.6).
A step that fails on the compute thread (out of memory, a bad batch, Ctrl-C) first fails the jobs
waiting on it, so the error reaches the caller and the process can exit.

The step's global norm decides its clipping and, under the non-finite guard, whether it updates
anything (slidedp/gradient_flow.py). When every unit's update runs on the GPU (`GradientFlow.norm_on_device`), the norm, the clipping
coefficient and the guard's test are taken there too, and the updates are queued behind backward
before the host reads the norm: fused AdamW scales each gradient and skips a non-finite step on
the device.
"""

import os
from dataclasses import replace
from typing import Callable, Iterator

import torch

from models.kernels import resolve_kernels
from protocols.backend import Batch, StepResult
from protocols.bounds import check_field
from protocols.model_spec import ModelArgs, spec_of
from protocols.reconfigure import Knobs
from slidedp import affinity, cpu_adam, state_io
from slidedp.activations import Offloader, block_policies
from slidedp.block_runner import BlockPolicies, BlockRunner
from slidedp.config import EmbeddingUpdate, SlideDPConfig
from slidedp.gpu_update import check_gpu_updates, gpu_updated_units
from slidedp.gradient_flow import GradientFlow, StepUpdate
from slidedp.holds import Hold
from slidedp.host_memory import HostMemoryCheck
from slidedp.host_state import SharedHostState, StepAborted, updates_deferred
from slidedp.layout import StateLayout, chunk_elems
from slidedp.node_shards import master_parameters, node_shards
from slidedp.nodes import Nodes, ReplicaCheck, node_fields
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.rank_groups import RankGroups
from slidedp.routes.build import build_routes, check_routes
from slidedp.run_config import RunConfig
from slidedp.save_gate import SaveGate
from slidedp.speculative import check_speculative
from slidedp.state_file import read_master, save_shards
from slidedp.step_metrics import Laps, StepTimes
from slidedp.streams import Streams
from slidedp.traffic import Traffic
from slidedp.update import AdamHyper, HostOptimizer
from slidedp.update_order import UPDATE_ORDERS


PARALLEL_INIT_PARAMS = 1_000_000_000
"""Random init above this many parameters draws each unit from its own generator, in parallel
(slidedp/state_io.py init_weights)."""


class SlideDPBackend:
    """Host-resident layer streaming with synchronous data-parallel semantics."""

    def __init__(self, config: RunConfig, model_args: ModelArgs, *, device: torch.device,
                 dp_rank: int, dp_world: int):
        tr, opt = config.training, config.optimizer
        lap = Laps()
        self.build_s = lap.seconds
        # The runtime style (slidedp/peer_styles.py) sets its own routes and shadow.
        self.style = RUNTIME_STYLES[config.slidedp.runtime]
        cfg = self.style.configure(config.slidedp)
        self.cfg, self.args, self.device = cfg, model_args, device
        self.spec = spec_of(model_args)
        # The same kernels as every other mode, for the blocks run on streamed weights.
        kernels = self.kernels = resolve_kernels(config.model.kernels,
                                                 attention=config.model.attention,
                                                 device_type=device.type)
        # Several nodes: a replica of the host state each (nodes.py), or a share (node_shards.py).
        self.nodes = Nodes.discover(rank=dp_rank, world=dp_world)
        self.nodes.check_same(node_fields(config, model_args))
        self.shards = node_shards(self.nodes, cfg)
        self.leader = dp_rank == 0  # prints the start-up report
        self.rank, self.world = self.nodes.local_rank, self.nodes.local_world
        self.max_norm = tr.max_norm
        self.guard = tr.nonfinite != "off"
        self.deferred = updates_deferred(max_norm=tr.max_norm, nonfinite=tr.nonfinite,
                                         reduction=cfg.reduction)
        self.layout = StateLayout(model_args, world=self.shards.world, nodes=self.shards.nodes,
                                  sole_owner=self.style.sole_owner)
        check_gpu_updates(cfg, grad_accum_steps=tr.grad_accum_steps, n_layers=model_args.n_layers,
                          world=self.world)
        check_speculative(cfg, grad_accum_steps=tr.grad_accum_steps, n_layers=model_args.n_layers)
        memory = HostMemoryCheck(self.layout, model_args, cfg, grad_accum_steps=tr.grad_accum_steps,
                                 max_norm=tr.max_norm, nonfinite=tr.nonfinite, leader=self.leader,
                                 shards=self.shards)
        memory.check(offload_pool=None)
        # The policies' costs, measured on one block before anything big is allocated, size the
        # activation offload pool of the micro-batch the run is configured for.
        self.blocks = BlockPolicies(model_args, kernels, device=device, leader=self.leader,
                                    micro_shape=(tr.local_batch_size, tr.seq_len),
                                    local_world=self.world, check=cfg.check_host_memory)
        self.blocks.set(block_policies(model_args.n_layers, default=cfg.activation,
                                       blocks=cfg.activation_blocks, keep_blocks=cfg.keep_blocks))
        memory.check(offload_pool=self.blocks.pool_bytes(*self.blocks.micro_shape))
        lap("checks and activation costs")

        self.groups = RankGroups(self.nodes, self.shards, distributed=dp_world > 1)
        self.state = SharedHostState(self.layout, memory.plan, rank=self.shards.first + self.rank,
                                     world=self.shards.world, share=self.groups.share,
                                     barrier=self.groups.barrier, pin=device.type == "cuda",
                                     label=self.nodes.label, shards=self.shards)
        lap("host state")
        state_io.init_weights(self.state, self.spec, model_args, hf_dir=config.model.hf_dir,
                              seed=tr.seed, parallel_above=PARALLEL_INIT_PARAMS)
        self.groups.barrier()
        lap("weights")

        self.groups.open(device)
        self.replicas = ReplicaCheck(self.nodes, every=cfg.replica_check_every,
                                     cross=self.groups.cross_host, local=self.groups.host)
        self.streams = Streams(device)
        self.traffic = Traffic()
        threads = cfg.cpu_threads or self._default_threads()
        self.optimizer = HostOptimizer(self.state, AdamHyper(beta1=opt.beta1, beta2=opt.beta2,
                                                             eps=opt.eps,
                                                             weight_decay=opt.weight_decay),
                                       threads=threads)
        self._accum_steps = tr.grad_accum_steps
        self.workers = affinity.RuntimeThreads(self.streams.bind_thread)
        self.times = StepTimes()
        self._save_gate = SaveGate()
        self.flow = GradientFlow(self.state, self.streams, self.optimizer,
                                 updater=self.workers.updater,
                                 order=UPDATE_ORDERS[cfg.update_order], save_gate=self._save_gate,
                                 times=self.times, device=device, deferred=self.deferred)
        self._set_gpu_updates(cfg.embedding_update)
        lap("groups and GPU updates")

        self.offloader = Offloader(self.streams, self.traffic)
        self.runner = BlockRunner(self.spec, model_args, self.layout, kernels=kernels,
                                  device=device, streams=self.streams, offloader=self.offloader,
                                  blocks=self.blocks, flow=self.flow, times=self.times,
                                  deliverer=self.workers.deliverer, window_slots=cfg.window_slots,
                                  loss_chunk=tr.loss_chunk_tokens)
        self._set_routes(delivery=cfg.delivery, reduction=cfg.reduction, chunk_mib=cfg.chunk_mib)
        self.blocks.ensure_pool(self.offloader, *self.blocks.micro_shape, checked=True)
        lap("routes, window and offload pool")

        self._pinned = cfg.pin_threads
        if self._pinned:
            self._pin_threads(threads)
        self.steps_done = 0  # steps taken, skipped ones included: the version of the state
        self.adam_steps = 0  # updates applied: Adam's step count (bias correction)

    # The parts, by the names the recipes and tests know them by.
    grad_return = property(lambda self: self.flow.route)
    delivery = property(lambda self: self.runner.delivery)
    gpu_updates = property(lambda self: self.flow.gpu_updates)
    policies = property(lambda self: self.blocks.policies)
    activation_costs = property(lambda self: self.blocks.costs)

    # ---- reconfiguration ----------------------------------------------------------------------

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
                             chunk_mib=(self.cfg.chunk_mib if knobs.chunk_mib is None
                                        else knobs.chunk_mib))
        if knobs.window_slots is not None and knobs.window_slots != self.cfg.window_slots:
            self._drain()
            self.runner.set_window_slots(knobs.window_slots)
            self.cfg = replace(self.cfg, window_slots=knobs.window_slots)
        if knobs.activation is not None:
            self.blocks.set(block_policies(self.args.n_layers, default=knobs.activation,
                                           blocks=knobs.activation_blocks,
                                           keep_blocks=knobs.keep_blocks))
        if knobs.embedding_update is not None:
            self._set_gpu_updates(knobs.embedding_update)
        if knobs.update_order is not None:
            # Timing only: the updates still queued simply follow the new order.
            self.flow.queue.order = UPDATE_ORDERS[knobs.update_order]
        if knobs.cpu_threads is not None:
            # Timing only (the CPU Adam's result does not depend on it): pending updates finish
            # first, with the old count.
            self._drain()
            self.optimizer.threads = self.grad_return.threads = (knobs.cpu_threads
                                                                 or self._default_threads())
            if self._pinned:
                self._pin_threads(self.optimizer.threads)

    def _set_routes(self, *, delivery: str, reduction: str, chunk_mib: float) -> None:
        """The parameter and gradient routes and the chunk of the copy and update pipelines
        (slidedp/routes.py)."""
        check_routes(self.cfg, delivery=delivery, reduction=reduction, style=self.style,
                     nodes=self.nodes, state=self.state, grad_accum_steps=self._accum_steps,
                     n_layers=self.args.n_layers, deferred=self.deferred)
        self._drain()
        self.cfg = replace(self.cfg, delivery=delivery, reduction=reduction, chunk_mib=chunk_mib)
        self.runner.delivery, self.flow.route = build_routes(
            self.state, self.streams, delivery=delivery, reduction=reduction,
            chunk_elems=chunk_elems(chunk_mib), groups=self.groups, traffic=self.traffic,
            threads=self.optimizer.threads, style=self.style)

    def _set_gpu_updates(self, where: EmbeddingUpdate) -> None:
        """slidedp.embedding_update, with slidedp.gpu_state_blocks; pending updates finish first,
        where they were to run, and resident state goes home (the new ones fetch it)."""
        cfg = replace(self.cfg, embedding_update=where)
        check_gpu_updates(cfg, grad_accum_steps=self._accum_steps, n_layers=self.args.n_layers,
                          world=self.world)
        self._drain()
        self.cfg = cfg
        self.flow.set_gpu_updates(gpu_updated_units(cfg, self.args.n_layers), self.traffic)

    def _pin_threads(self, update_threads: int) -> None:
        """slidedp.pin_threads (slidedp/affinity.py)."""
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.world))
        self.workers.pin(local_rank=local_rank, local_world=self.world,
                         update_threads=update_threads)

    def _default_threads(self) -> int:
        # A sole owner (rank 0) runs every update: the host's cores are its alone.
        return cpu_adam.default_num_threads(local_world=1 if self.style.sole_owner else self.world)

    def reset_optimizer(self) -> None:
        """The optimizer state of a fresh start, weights untouched: this rank's Adam moments
        zero, Adam's step count and the step counter 0 (AutoPolicy measures with lr = 0, which
        leaves the weights as they were but moves the moments)."""
        self._drain()
        self.groups.barrier()  # no peer's delivery reads our version counters any more
        state_io.reset_moments(self.state)
        for g in self.gpu_updates.values():
            g.invalidate()
        self.steps_done = self.adam_steps = 0
        self.groups.barrier()

    # ---- the step -----------------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch], *, lr: float, global_target_tokens: int) -> StepResult:
        if self.state.aborted.is_set():
            raise RuntimeError("SlideDP: an earlier step failed on this rank; its host state is "
                               "mid-update, so restart from the last checkpoint")
        # Refused before any work if the host state has no place for the step's gradients.
        hold = self.grad_return.hold(self.state.plan, n_micro=len(micro_batches),
                                     deferred=self.deferred)
        try:
            result = self._train_step(micro_batches, hold=hold, lr=lr,
                                      global_target_tokens=global_target_tokens)
        except BaseException as e:
            self._abort()
            cause = self.flow.failed_job()
            if isinstance(e, StepAborted) and cause is not None:
                raise cause  # a job of the update thread failed and stopped the waits
            raise
        if self.replicas.due(self.steps_done):
            # Outside the failed-step path: the step is complete, and every rank finds a
            # divergence in the same collective, so the backend still closes (its groups joined).
            self.replicas.check(self.state, step=self.steps_done)
        return result

    def _abort(self) -> None:
        """The step failed on the compute thread (out of memory, a bad batch, Ctrl-C). Its jobs
        would otherwise wait forever for buffer releases that will never come, or for counters,
        and keep the process from exiting: fail the releases and stop the counter waits. The
        offloaded activations and their host pool are freed now."""
        self.state.aborted.set()
        for g in self.gpu_updates.values():
            g.drop()
        self.runner.abort()
        self.offloader.clear()

    def _train_step(self, micro_batches: list[Batch], *, hold: Hold, lr: float,
                    global_target_tokens: int) -> StepResult:
        self.flow.reap()
        rope = self.spec.rope_tables(self.args, micro_batches[0][0].shape[1], self.device)
        self.blocks.ensure_pool(self.offloader, *micro_batches[0][0].shape)
        tail = self.times.new_tail(len(self.layout.units))
        self.flow.begin_step(hold, StepUpdate(lr=lr, adam_step=self.adam_steps + 1,
                                              version=self.steps_done + 1, tail=tail),
                             n_micro=len(micro_batches))
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro, (tokens, labels) in enumerate(micro_batches):
            self.flow.begin_micro_batch(micro)
            loss += self.runner.micro_batch(micro, tokens, labels, rope,
                                            global_tokens=global_target_tokens,
                                            version=self.steps_done)
        settled = self.flow.settle(loss, groups=self.groups, max_norm=self.max_norm,
                                   guard=self.guard, global_tokens=global_target_tokens,
                                   tail=tail)
        self.steps_done += 1
        if not settled.skipped:
            self.adam_steps += 1
        if self.style.update_after_backward:  # none overlaps the next step
            self._drain()
        extra = self.traffic.take()
        if self.flow.speculated:  # how often speculation pays: 1 when this step's updates are redone
            extra["speculative_redo"] = float(settled.coef != 1.0 or settled.skipped)
        extra.update(update_wait_s=settled.update_wait_s, **self.times.report())
        if self.replicas.due(self.steps_done):
            self._drain()  # the checksum reads this step's updates: they end first
        return StepResult(loss_sum=settled.loss_sum, grad_norm=settled.grad_norm, extra=extra,
                          skipped=settled.skipped)

    # ---- outside the step ---------------------------------------------------------------------

    def _drain(self) -> None:
        self.flow.drain()

    def named_master_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._drain()
        self.groups.barrier()  # every rank's shard of the last update is in place
        yield from master_parameters(self.state, self.groups.everyone)

    def snapshot_state(self, group) -> Callable[[str], None]:
        """Nothing is copied: the writer waits for the last step's pending updates, then writes
        this rank's shards (slidedp/state_file.py) unit by unit, in the order the next step
        updates them, and each unit's next update waits until the unit is written (SaveGate).
        Only this rank's shards are read, so the writer needs no peer (`group` is unused). Node 0
        alone writes replicas: the other nodes' are the same bytes (slidedp/nodes.py), and every
        node loads node 0's files on resume; sharded across nodes, every rank writes its own."""
        units = list(self.layout.units)
        if not self.deferred:  # the next step updates during backward: head first
            units.reverse()
        return state_io.snapshot_writer(
            self.state, units=units, steps=self.steps_done, adam_steps=self.adam_steps,
            pending=list(self.flow.pending),  # the last step's updates may still be running
            gpu_updates=list(self.gpu_updates.values()), gate=self._save_gate,
            save=save_shards, write_files=self.nodes.node == 0 or not self.shards.whole)

    def saved_master_parameters(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        return read_master(self.layout, path)

    def load_state(self, path: str) -> int:
        """Load this rank's shards (slidedp/state_io.py) and forget the GPU's copies of the
        state; returns the step reached."""
        self._drain()
        self.steps_done, self.adam_steps = state_io.load_state(self.state, path)
        for g in self.gpu_updates.values():
            g.invalidate()
        self.groups.barrier()  # every rank's shards are in place before any delivery reads them
        return self.steps_done

    def close(self) -> None:
        try:
            if not self.state.aborted.is_set():  # after a failed step the jobs end in StepAborted
                self._drain()
        finally:
            self.workers.shutdown()
            if not self.state.aborted.is_set():  # a failed rank's peers may still be in one
                self.replicas.cross = self.replicas.local = None
                self.delivery.group = self.grad_return.group = self.grad_return.cross = None
                self.groups.destroy()
            self.offloader.clear()
            self.runner.buffers.clear()
            self.state.close()


def build_slidedp_backend(config: RunConfig, model_args: ModelArgs, *, device: torch.device,
                          dp_rank: int, dp_world: int) -> SlideDPBackend:
    """The `parallelism.mode = "slidedp"` backend."""
    return SlideDPBackend(config, model_args, device=device, dp_rank=dp_rank, dp_world=dp_world)
