"""The embedding's AdamW on the GPU (slidedp.embedding_update = "gpu").

The embedding's gradient is the last of backward to be complete (tied, it holds the head's too),
and the next forward needs the embedding first, so its host update is the step's tail: the CPU
Adam is memory-bound, and a vocabulary of 152K rows makes the embedding the largest unit. The GPU
does the same AdamW in milliseconds if the state is there. So this rank's shard of the unit's FP32 master and moments (12 B/param)
is copied to the GPU while the last blocks' backward runs (`prefetch`), updated there in one
pass from the BF16 gradient (slidedp/gpu_adamw.py: torch's fused AdamW formula), and copied home
(`update`): the delivery source first (the BF16 shadow, or the FP32 master without one), whose
arrival opens the unit's version gate, then the rest of the FP32 state, whose arrival
(`wait_home`) saves and the next step's prefetch wait for. Semantics are those of the host
update: the same gradient, clipping coefficient, learning rate and step count.

Resident (slidedp.embedding_update = "resident", the first slidedp.gpu_state_blocks blocks, and
the head when those are all the others):
the copies are the unit's optimizer state, kept on the GPU from the first update on (ZeRO-Offload++'s
partial offload, per unit), with a BF16 copy of the shard that each update writes and the unit's
delivery reads on the GPU (`delivery_source`): nothing crosses PCIe per step, and the version
gate opens as soon as the update is issued (the copy waits for it on the device). The host's
master, moments and shadow are brought up to date only when the host's copy must be current
(`wait_home`: saves, reconfiguration, the end), and fetched again after the host state changed
(`invalidate`: a load, an optimizer reset). 14 B/param of GPU memory (10 with BF16 moments,
which stay BF16 there) buy an update that never waits for the CPU Adam: with clipping, the
updates wait for the step's norm, and the host updates of the first blocks the next forward
needs are its wait. Peers' deliveries read only their own shards (slidedp.delivery = "sharded",
or one rank).

On the CPU (tests) the "device" copies are ordinary tensors and every copy is synchronous.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import torch
import torch.distributed as dist

from slidedp.config import EmbeddingUpdate, MomentsDtype, SlideDPConfig
from slidedp.gpu_adamw import adamw_step
from slidedp.host_state import SharedHostState
from slidedp.layout import Unit, chunks
from slidedp.nodes import add_other_nodes_loss
from slidedp.streams import Streams
from slidedp.traffic import Traffic
from slidedp.update import AdamHyper

if TYPE_CHECKING:
    from slidedp.plan.steptime import StepBuilder

PREFETCH_AT_BLOCK = 4
"""The state's copy to the GPU is issued when backward reaches this block: the backward of the
blocks before it hides the copy, and by then nearly every saved activation is freed."""

GPU_CHUNK = 1 << 26
"""Elements per piece of the update: bounds its FP32 gradient temporary (256 MiB)."""
GPU_ADAM_BYTES = {"float32": 28, "bfloat16": 20}
"""Device bytes per parameter of an AdamW on the GPU (GpuUpdate.update, slidedp/gpu_adamw.py's
one pass), by the moments' dtype there: read the BF16 gradient (2) and p, m, v (12, or 8 with
resident BF16 moments), write p, m, v (12, or 8) and the BF16 copy of the weights (2: sent home,
or the resident copy)."""


def check_gpu_updates(cfg: SlideDPConfig, *, grad_accum_steps: int, n_layers: int,
                      world: int) -> None:
    """Refuse what the GPU update cannot serve on `world` ranks, before anything is
    allocated."""
    if cfg.embedding_update not in get_args(EmbeddingUpdate):
        raise ValueError(f"slidedp.embedding_update must be one of {get_args(EmbeddingUpdate)}, "
                         f"got {cfg.embedding_update!r}")
    if not 0 <= cfg.gpu_state_blocks <= n_layers:
        raise ValueError(f"slidedp.gpu_state_blocks: {cfg.gpu_state_blocks} is not within the "
                         f"model's 0..{n_layers} blocks")
    if cfg.moments_dtype not in get_args(MomentsDtype):
        raise ValueError(f"slidedp.moments_dtype must be one of {get_args(MomentsDtype)}, "
                         f"got {cfg.moments_dtype!r}")
    if cfg.moments_dtype == "8bit" and any(gpu_updated_units(cfg, n_layers).values()):
        raise ValueError('slidedp.moments_dtype = "8bit" needs every unit\'s optimizer state at '
                         'home: slidedp.gpu_state_blocks = 0 and slidedp.embedding_update = '
                         '"host" (resident state keeps FP32 or BF16 moments, not 8-bit codes)')
    if cfg.moments_dtype == "8bit" and cfg.embedding_update == "gpu":
        raise ValueError('slidedp.moments_dtype = "8bit" needs slidedp.embedding_update = "host": '
                         "the GPU update of a streamed embedding carries FP32 or BF16 moments, "
                         "not 8-bit codes")
    if cfg.embedding_update == "host" and cfg.gpu_state_blocks == 0:
        return
    # The update needs the summed gradient shard on the GPU: the gpu route, one micro-batch
    # (accumulated gradients are summed on the host), FP32 master weights.
    if cfg.runtime != "slidedp" or cfg.reduction != "gpu" or grad_accum_steps != 1:
        what = (f'slidedp.embedding_update = "{cfg.embedding_update}"'
                if cfg.embedding_update != "host" else "slidedp.gpu_state_blocks > 0")
        raise ValueError(f'{what} needs slidedp.runtime = "slidedp", slidedp.reduction = "gpu" '
                         f'and training.grad_accum_steps = 1 (got {cfg.runtime!r}, '
                         f'{cfg.reduction!r}, {grad_accum_steps})')
    if (world > 1 and cfg.delivery == "replicated"
            and any(gpu_updated_units(cfg, n_layers).values())):
        # A resident unit's new weights stay on its owner's GPU: peers cannot copy that shard.
        raise ValueError('resident optimizer state (slidedp.gpu_state_blocks > 0, or '
                         'slidedp.embedding_update = "resident") on several ranks needs '
                         'slidedp.delivery = "sharded"')


def gpu_updated_units(cfg: SlideDPConfig, n_layers: int) -> dict[int, bool]:
    """The unit indices (0 the embedding, 1 + i block i, 1 + n_layers the head) whose AdamW runs
    on the GPU, each with whether its state stays there. The head's state stays there too when
    every other unit's does, so that no update is left to the host."""
    units = {1 + i: True for i in range(cfg.gpu_state_blocks)}
    if cfg.embedding_update != "host":
        units[0] = cfg.embedding_update == "resident"
    if cfg.embedding_update == "resident" and cfg.gpu_state_blocks == n_layers:
        units[1 + n_layers] = True
    return units


@dataclass(frozen=True)
class GradScale:
    """What a GPU update does to its gradient, as the device tensors fused AdamW reads: divides it
    by `divisor` (1 / the clipping coefficient; None: by 1) and skips the update where `found_inf`
    is 1 (None: never); both are complete at `ready`."""

    divisor: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


def device_clip(normsq: torch.Tensor, loss: torch.Tensor, *, max_norm: float, guard: bool,
                group: dist.ProcessGroup | None, streams: Streams,
                cross: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, GradScale]:
    """The step's totals (squared gradient norm, loss) summed over `group`'s ranks (the loss
    over every node's too, `cross`: slidedp/nodes.py), and the
    GradScale of clipping to `max_norm` (0: none) and of the non-finite guard, issued on the
    current stream from this rank's device tensors: for a step whose every update runs on the
    GPU, so that they are queued without the host reading the norm first. The formula is the
    host's (engine.py): coef = min(1, max_norm / (norm + 1e-6))."""
    totals = torch.stack([normsq.double(), loss.double()])
    if group is not None:
        dist.all_reduce(totals, group=group)
    add_other_nodes_loss(totals, cross)
    divisor = found_inf = None
    if max_norm > 0:
        coef = (max_norm / (totals[0].sqrt() + 1e-6)).clamp(max=1.0)
        divisor = coef.reciprocal().float()
    if guard:
        found_inf = torch.isfinite(totals).all().logical_not().float()
    return totals, GradScale(divisor, found_inf, streams.record())


STATE_REGIONS = ("master", "exp_avg", "exp_avg_sq")
"""The host regions a GPU update copies to and from the GPU: pinned (SharedHostState.pin_units)
over all its units before they are built, so the copies are DMA on the stream, not staged by
the issuing thread."""


class GpuUpdate:
    """AdamW of one unit's shard (this rank's) on the GPU; one step at a time. Its units' ranges
    of STATE_REGIONS are pinned first."""

    def __init__(self, state: SharedHostState, streams: Streams, hyper: AdamHyper, unit: Unit, *,
                 rank: int, world: int, traffic: Traffic, resident: bool = False):
        self.state, self.streams, self.hyper, self.unit = state, streams, hyper, unit
        self.traffic, self.resident = traffic, resident
        self._ahead = False  # resident: the GPU's FP32 state is newer than the host's
        self.lo, self.hi = unit.shard(rank, world)
        self.stream = streams.new_stream()
        self._pieces: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._home: torch.cuda.Event | None = None
        # Resident: the shard in BF16 on the GPU, and the event after its last write.
        self._weights: torch.Tensor | None = None
        self._weights_ready: torch.cuda.Event | None = None

    def prefetch(self) -> None:
        """Copy the shard's master and moments to the GPU on the update stream (compute thread,
        during backward), as FP32; BF16 moments are widened there and rounded on the way home
        (streamed), or stay BF16 (resident: 10 B/param, not 14), each update widening, updating
        and rounding them as the CPU Adam does. The copies are allocated on the compute stream,
        so the memory goes back to the common pool once the update has used them; the stream
        orders them after the previous step's copies home. Once per step (resident: once until
        `invalidate`): later calls do nothing."""
        if self._pieces is not None:
            return
        pieces = []
        for a in range(self.lo, self.hi, GPU_CHUNK):
            b = min(a + GPU_CHUNK, self.hi)
            copies = [torch.empty(b - a, dtype=self._dtype(region), device=self.streams.device)
                      for region in STATE_REGIONS]
            # The allocator may hand out memory that kernels already queued on the compute
            # stream still read or write (a tensor freed by the host is reused at once there):
            # the copies into it wait for those kernels. Unordered, the copies overwrite
            # backward's inputs while it runs far behind the host (large micro-batches), and the
            # gradients come out NaN (tests/test_gpu_update.py).
            allocated = self.streams.record()
            with self.streams.use(self.stream):
                self.streams.wait(allocated, self.stream)
                for copy, region in zip(copies, STATE_REGIONS):
                    if self.streams.is_cuda:
                        copy.record_stream(self.stream)
                    copy.copy_(self.state.unit_view(region, self.unit.index, a, b),
                               non_blocking=True)
            pieces.append((a, b, *copies))
        self.traffic.gpu_update_h2d += (self.hi - self.lo) * sum(
            self.state.regions[region].element_size() for region in STATE_REGIONS)
        if self.resident:  # the delivery source, cast on the GPU as the shadow was on the host
            weights = torch.empty(self.hi - self.lo, dtype=torch.bfloat16,
                                  device=self.streams.device)
            with self.streams.use(self.stream):
                if self.streams.is_cuda:
                    weights.record_stream(self.stream)
                for a, b, param, _, _ in pieces:
                    weights[a - self.lo:b - self.lo].copy_(param)
                self._weights_ready = self.streams.record(self.stream)
            self._weights = weights
        self._pieces = pieces

    def _dtype(self, region: str) -> torch.dtype:
        """The GPU copy's dtype of a state region: resident BF16 moments stay BF16."""
        host = self.state.regions[region].dtype
        return host if self.resident and host == torch.bfloat16 else torch.float32

    def drop(self) -> None:
        """Forget the prefetched copies (a skipped step, or a failed one); resident ones are
        the unit's state itself, untouched by a step that did not update."""
        if not self.resident:
            self._pieces = None

    def invalidate(self) -> None:
        """The host state changed (a load, an optimizer reset): the next update fetches it."""
        Streams.synchronize(self._home)
        Streams.synchronize(self._weights_ready)
        self._pieces, self._ahead, self._weights = None, False, None

    def delivery_source(self) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """Resident, once fetched: the shard in BF16 on the GPU and the event its copy must wait
        for (the last update's). Else None: the delivery reads the host."""
        return None if self._weights is None else (self._weights, self._weights_ready)

    def update(self, grad: torch.Tensor, ready: torch.cuda.Event | None, *,
               scale: float | GradScale, lr: float, step: int) -> None:
        """AdamW of the shard with `grad` (its BF16 summed gradient on the GPU, complete at
        `ready`) scaled by `scale` (the host's clipping coefficient) or as a GradScale says,
        at Adam step `step`. Returns once the delivery source is home (resident: once the update
        is issued; the source is on the GPU), and the caller then opens the version gate; the
        FP32 state follows (`wait_home`)."""
        self.prefetch()  # issued at PREFETCH_AT_BLOCK unless the model has fewer blocks
        pieces = self._pieces
        if not self.resident:
            self._pieces = None
        h, source = self.hyper, "shadow" if self.state.plan.bf16_shadow else "master"
        with self.streams.use(self.stream):
            self.streams.wait(ready, self.stream)
            if not isinstance(scale, GradScale):
                scale = GradScale(None if scale == 1.0 else torch.full(
                    (), 1.0 / scale, dtype=torch.float32, device=self.streams.device))
            self.streams.wait(scale.ready, self.stream)
            if self.streams.is_cuda:  # made on other streams, read on this one
                for t in (grad, scale.divisor, scale.found_inf):
                    if t is not None:
                        t.record_stream(self.stream)
            for a, b, param, exp_avg, exp_avg_sq in pieces:
                # The BF16 copy the next delivery reads: resident, the unit's own on the GPU;
                # else the shadow's, copied home below (none for an FP32 master source).
                out = (self._weights[a - self.lo:b - self.lo] if self.resident else
                       torch.empty(b - a, dtype=torch.bfloat16, device=param.device)
                       if source == "shadow" else None)
                adamw_step(param, exp_avg, exp_avg_sq, grad[a - self.lo:b - self.lo], out=out,
                           lr=lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay,
                           eps=h.eps, step=step, divisor=scale.divisor,
                           found_inf=scale.found_inf)
                if not self.resident:
                    self.state.unit_view(source, self.unit.index, a, b).copy_(
                        param if out is None else out, non_blocking=True)
            source_home = self.streams.record(self.stream)
        if self.resident:
            self._weights_ready, self._ahead = source_home, True
            return
        self.traffic.gpu_update_d2h += (self.hi - self.lo) * (2 if source == "shadow" else 4)
        self._copy_home(pieces, skip=source)
        Streams.synchronize(source_home)

    def _copy_home(self, pieces, *, skip: str | None) -> None:
        """The state to host memory on the update stream, but for region `skip` (already home):
        the FP32 master and moments, and the shadow from the resident BF16 copy; `_home` is
        recorded after it."""
        with self.streams.use(self.stream):
            for a, b, param, exp_avg, exp_avg_sq in pieces:
                copies = [(param, "master"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")]
                if self._weights is not None and self.state.plan.bf16_shadow:
                    copies.append((self._weights[a - self.lo:b - self.lo], "shadow"))
                for copy, region in copies:
                    if region != skip:
                        self.state.unit_view(region, self.unit.index, a, b).copy_(
                            copy, non_blocking=True)
                        self.traffic.gpu_update_d2h += (b - a) * self.state.regions[
                            region].element_size()  # as stored: BF16 moments are cast first
            self._home = self.streams.record(self.stream)

    def wait_home(self) -> None:
        """Block until the unit's state is in host memory: the last update's copies, or,
        resident, copies issued now if the GPU's state is ahead (the caller holds the unit's
        next update back until this returns)."""
        if self.resident and self._ahead:
            self._copy_home(self._pieces, skip=None)
            self._ahead = False
        Streams.synchronize(self._home)


def simulate_state_copy(b: "StepBuilder", r: int, per_elem: int, direction: str, deps) -> int:
    """The step-time model's copy of `per_elem` bytes per element of rank r's embedding shard
    between the host and its GPU on the update stream (`prefetch`, `_copy_home`): a copy per
    region (4 B/elem each, the BF16 shadow one) per piece of GPU_CHUNK elements."""
    shard = b.spec.unit_elems[0] // b.spec.world
    return b.copy(f"gstream:{r}", r, per_elem * shard, direction, deps, kind=direction,
                  n_chunks=len(chunks(shard, GPU_CHUNK)) * -(-per_elem // 4))


def simulate_gpu_update(b: "StepBuilder", r: int, unit: int, deps) -> tuple[int, int]:
    """The step-time model's GpuUpdate.update of `unit` on rank r's GPU: (the update thread's
    end of it, where the version gate opens; the update's kernel, which the unit's next use on
    the GPU waits for). Streamed (the embedding): its delivery source goes home, which the
    update thread waits for, and the rest of its state after it. Resident: the thread only
    issues it; the next use waits for it on the device."""
    shard, shadow = b.spec.unit_elems[unit] // b.spec.world, b.spec.bf16_shadow
    resident = unit in b.spec.resident_units
    moments = b.spec.moments if resident and b.spec.moments == "bfloat16" else "float32"
    seconds = shard * GPU_ADAM_BYTES[moments] / (b.rates.hbm_gbs * 1e9)
    # On the unit's update stream: beside the compute stream, sharing the GPU with it.
    if resident:
        issued = b.add(f"uthread:{r}", deps=deps, kind="issue")
        return issued, b.add(f"gstream:{r}", work={f"gpu:{r}": seconds}, deps=[issued],
                             kind="gpu update")
    adam = b.add(f"gstream:{r}", work={f"gpu:{r}": seconds},
                 deps=[*deps, b.ranks[r].state_on_gpu], kind="gpu update")
    home = simulate_state_copy(b, r, 2 if shadow else 4, "d2h", [adam])
    simulate_state_copy(b, r, 12 if shadow else 8, "d2h", [home])  # the next prefetch waits
    synced = b.add(f"uthread:{r}", deps=[home], kind="sync")
    return synced, synced
