"""The compute walk of a micro-batch through the GPU window, driven by the model spec.

The compute thread runs forward and backward block by block through the window's buffers; the
delivery thread runs the version gate and the host->GPU copy (+ all-gather) into a free buffer,
ahead of use (one job per planned delivery, in use order). Handshakes are futures carrying CUDA
events, so waits happen on the device wherever possible. The plan of a micro-batch
(slidedp/schedule.py) is plain data; the futures of its uses live here. Each block runs under
its activation policy (slidedp/activations/: keep, recompute, segment masks, op-level saves,
offload to host), an object the compute thread calls. Each unit's gradient goes to the gradient
flow (slidedp/gradient_flow.py) as soon as backward has made it.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.autograd.graph import get_gradient_edge

from models.kernels import Kernels
from models.meta import on_meta
from protocols.model_spec import ModelArgs, ModelSpec
from slidedp.activations import (ActivationPolicy, BlockCost, BlockSegments, Offloader,
                                 WeightRefs, block_input, describe_costs, measure_costs,
                                 offload_bytes)
from slidedp.routes.delivery import Delivery
from slidedp.gpu_update import PREFETCH_AT_BLOCK
from slidedp.gradient_flow import GradientFlow
from slidedp.host_state import StepAborted, available_host_bytes
from slidedp.layout import StateLayout, Unit
from slidedp.schedule import Use, plan_micro_batch
from slidedp.step_metrics import StepTimes
from slidedp.streams import Streams


class BlockPolicies:
    """The blocks' activation policies, their costs measured on one block, and the offload pool
    they size."""

    def __init__(self, args: ModelArgs, kernels: Kernels, *, device: torch.device,
                 micro_shape: tuple[int, int], leader: bool, local_world: int, check: bool):
        """`micro_shape`: the (batch, seq) the run is configured for; `leader` prints; `check`:
        refuse a pool the node's `local_world` ranks have no host memory for."""
        self.args, self.kernels, self.device, self.leader = args, kernels, device, leader
        self.micro_shape, self.local_world, self.check = micro_shape, local_world, check
        self.costs: dict[ActivationPolicy, BlockCost] = {}
        self.policies: list[ActivationPolicy] = []

    def set(self, policies: list[ActivationPolicy]) -> None:
        """Between steps policies can change freely (only the compute thread reads them, and a
        step's saved activations are gone by its end). A larger offload pool, if the new
        policies need one, is allocated before the next step."""
        new = set(policies) - self.costs.keys()
        if new:
            self.costs.update(measure_costs(new, self.args, self.kernels, device=self.device,
                                            seq_len=self.micro_shape[1]))
        self.policies = policies
        if self.leader:
            print(describe_costs(policies, self.costs, *self.micro_shape), flush=True)

    def pool_bytes(self, batch: int, seq: int) -> int:
        return offload_bytes(self.policies, self.costs, batch, seq)

    def ensure_pool(self, offloader: Offloader, batch: int, seq: int, *,
                    checked: bool = False) -> None:
        """Grow this rank's offload pool to what the policies need for micro-batches of `batch`
        x `seq` tokens (between steps: nothing is in flight); `checked`: the host-memory check
        counted it."""
        need = self.pool_bytes(batch, seq)
        grow = need - offloader.pool.nbytes
        if grow <= 0:
            return
        if not checked:
            have = available_host_bytes()
            if self.leader:
                print(f"[slidedp] activation offload pool grows to {need / 2**30:.2f} GiB per "
                      f"rank for {batch} x {seq} tokens per micro-batch", flush=True)
            if grow * self.local_world > have and self.check:
                raise MemoryError(f"SlideDP: the activation offload pool needs "
                                  f"{grow * self.local_world / 2**30:.2f} GiB more host memory, "
                                  f"{have / 2**30:.2f} GiB is available (offload less)")
        offloader.pool.allocate(need)


class BlockRunner:
    """Forward and backward of a micro-batch over the window's buffers, fed by the deliveries."""

    def __init__(self, spec: ModelSpec, args: ModelArgs, layout: StateLayout, *,
                 kernels: Kernels, device: torch.device, streams: Streams,
                 offloader: Offloader, blocks: BlockPolicies, flow: GradientFlow,
                 times: StepTimes, deliverer: ThreadPoolExecutor, window_slots: int,
                 loss_chunk: int):
        self.spec, self.args, self.units, self.device = spec, args, layout.units, device
        self.streams, self.offloader, self.blocks, self.flow = streams, offloader, blocks, flow
        self.times, self._deliverer, self.loss_chunk = times, deliverer, loss_chunk
        self.window_slots = window_slots
        self._block_padded = layout.block_padded
        bf16 = dict(dtype=torch.bfloat16, device=device)
        self.buffers = [torch.empty(layout.block_padded, **bf16) for _ in range(window_slots)]
        self.buffers.append(torch.empty(layout.embed.padded, **bf16))
        self.buffers.append(torch.empty(layout.head.padded, **bf16))
        with on_meta():
            self.segments = BlockSegments(spec.block_cls(args, kernels))
        self.head_loss = spec.head_loss(args, kernels)
        self._unit_source: dict[int, torch.Tensor] = {}  # what each unit's compute reads now
        self.weight_refs = WeightRefs(self.buffers, self._unit_source.__getitem__)
        self._prefetch_block = min(PREFETCH_AT_BLOCK, args.n_layers - 1)
        self.delivery: Delivery | None = None  # the delivery route (reconfigurable)
        self._last_release: dict[int, Future | None] = {b: None for b in range(len(self.buffers))}
        self._resident: dict[int, int] = {}
        # The current micro-batch's runtime state, by use: resolved by the compute thread with the
        # event after the use's last kernel; by the delivery thread with the arrival event.
        self._released: list[Future] = []
        self._delivered: list[Future | None] = []

    def set_window_slots(self, slots: int) -> None:
        """The slots are allocated anew and the next step delivers every block (the pending
        updates have finished)."""
        Streams.synchronize(self.streams.record())  # no kernel or copy uses a slot any more
        del self.buffers[:self.window_slots]  # the same list: the deliveries index it
        self.buffers[:0] = [torch.empty(self._block_padded, dtype=torch.bfloat16,
                                        device=self.device) for _ in range(slots)]
        self.window_slots = slots
        # The saved-tensor hooks know the buffers by address: the new ones too.
        self.weight_refs = WeightRefs(self.buffers, self._unit_source.__getitem__)
        self._last_release = {b: None for b in range(len(self.buffers))}
        self._resident = {}

    def abort(self) -> None:
        """The step failed on the compute thread: the buffer releases its jobs wait for fail."""
        for released in self._released:
            if not released.done():
                released.set_exception(StepAborted("SlideDP: the step using this buffer failed"))

    def micro_batch(self, micro: int, tokens: torch.Tensor, labels: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor], *, global_tokens: int,
                    version: int) -> torch.Tensor:
        """Plan the micro-batch, deliver its units at `version` and run it; returns its loss."""
        offload = [p.offload for p in self.blocks.policies]
        uses, self._resident = plan_micro_batch(
            self.args.n_layers, self.window_slots, resident=self._resident if micro else {},
            embed_head_resident=micro > 0, offload=offload)
        self._submit_deliveries(uses, version)
        return self._walk(uses, tokens.to(self.device, non_blocking=True),
                          labels.to(self.device, non_blocking=True), rope,
                          global_tokens=global_tokens)

    def leaves(self, unit: Unit, *, grad: bool) -> dict[str, torch.Tensor]:
        buf = self._unit_source[unit.index]
        return {p.local_name: buf[p.offset:p.offset + p.numel].view(p.shape).detach().requires_grad_(grad)
                for p in unit.params}

    def _deliver_job(self, use: Use, after: Future | None, version: int):
        if after is not None:
            self.streams.wait(after.result(), self.delivery.stream)
        unit = self.units[use.unit]
        with self.times.timed("gate_wait_s"):
            self.delivery.wait_version(unit, version)
        # A resident unit's shard is on the GPU once its state is (read after the gate: the
        # version's update is issued by then).
        g = self.flow.gpu_updates.get(unit.index)
        with self.times.timed("deliver_s"):
            return self.delivery.deliver(unit, self.buffers[use.buffer],
                                         g.delivery_source() if g is not None else None)

    def _submit_deliveries(self, uses: list[Use], version: int) -> None:
        self._released, self._delivered = [], []
        for use in uses:
            self._delivered.append(self._deliverer.submit(
                self._deliver_job, use, self._last_release[use.buffer], version)
                if use.deliver else None)
            self._released.append(Future())
            self._last_release[use.buffer] = self._released[-1]

    def _wait_buffer(self, k: int, use: Use) -> None:
        if self._delivered[k] is not None:
            with self.times.timed("delivery_wait_s"):
                done, source = self._delivered[k].result()
            self.streams.wait(done)
            if source is not self.buffers[use.buffer]:  # a resident unit's own BF16 copy
                self.weight_refs.keep(source)
                if self.streams.is_cuda:  # an invalidate may drop it while compute reads it
                    source.record_stream(torch.cuda.current_stream(self.device))
            self._unit_source[use.unit] = source  # an undelivered use's unit is still there

    def _walk(self, uses: list[Use], tokens: torch.Tensor, labels: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor], *, global_tokens: int) -> torch.Tensor:
        saved: dict[int, tuple] = {}
        self.offloader.begin_micro_batch()
        # Set by the uses in their fixed order: embed fwd (h0, emb), head (loss, grad_h), ...
        # Graphs are held by their gradient edges, not by their output tensors, whose memory
        # the next block's policy decides about.
        h = h0 = emb = grad_h = loss = None
        for k, use in enumerate(uses):
            self._wait_buffer(k, use)
            if use.prefetch is not None:
                self.offloader.prefetch(use.prefetch)
            unit = self.units[use.unit]
            if unit.kind == "embed" and use.phase == "fwd":
                emb = self.leaves(unit, grad=True)
                h = self.spec.embed(emb, tokens)
                h0 = get_gradient_edge(h)
                h = h.detach()
            elif unit.kind == "embed":
                torch.autograd.backward(h0, grad_h)
                self.flow.submit(unit, emb)
            elif unit.kind == "head":
                h_in = h.requires_grad_()
                head = self.leaves(unit, grad=True)
                loss = self.head_loss(head, emb, h_in, labels,
                                      chunk_tokens=self.loss_chunk) / global_tokens
                loss.backward()
                grad_h = h_in.grad
                self.flow.submit(unit, head)
            elif use.phase == "fwd":
                h = self._block_forward(unit, use, h, rope, saved)
            else:
                if unit.index - 1 == self._prefetch_block and 0 in self.flow.gpu_updates:
                    self.flow.gpu_updates[0].prefetch()  # the embedding's state, for its update
                out, grad_in, leaves = saved.pop(unit.index)
                torch.autograd.backward(out, grad_h)
                (grad_h,) = grad_in
                self.offloader.release(unit.index)
                self.flow.submit(unit, leaves)
            self._released[k].set_result(self.streams.record())
        return loss.detach()

    def _block_forward(self, unit: Unit, use: Use, h: torch.Tensor, rope,
                       saved: dict) -> torch.Tensor:
        """The block's forward under its policy; what backward needs goes into `saved`."""
        grad_in: list[torch.Tensor] = []  # the input's gradient, appended by backward
        leaves = self.leaves(unit, grad=True)
        with (self.offloader.forward_of(unit.index, use.offload) as offload,
              self.weight_refs.during_forward_of(unit.index, offload)):
            out = self.blocks.policies[unit.index - 1].forward(self.segments,
                                                               block_input(h, grad_in),
                                                               leaves, rope)
        saved[unit.index] = (get_gradient_edge(out), grad_in, leaves)
        return out.detach()
