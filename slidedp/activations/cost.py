"""What a policy costs one block, measured on the device: what a planner weighs.

`measure_costs` builds one block of the run's model on the device (its kernels, BF16, random
weights) and runs forward and backward under each policy, the way the engine does
(`block_input`, the policy's forward on BlockSegments), at three small shapes:

- bytes kept from forward to backward: the distinct storages saved through autograd's hooks
  (models/activation_memory.SavedStorages, weights excluded) and, for SavedOps, the outputs of
  the ops it saves. With SDPA each grows with the tokens, or with the positions only (the RoPE
  tables a block casts), or not at all (RNG seeds), so three shapes give `Bytes` exactly. Host
  bytes are the policy's offload fraction of the hook-saved part (at most: a split rounds down
  to 512 bytes).
- FLOPs (torch's FlopCounterMode: matmuls, and SDPA on CUDA): per sequence a*s + b*s^2 (the
  attention is quadratic), given per token at the run's sequence length; what backward replays
  is its FLOPs less those of `keep`'s backward.
"""

import math
from dataclasses import dataclass, replace
from typing import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.activation_memory import SavedStorages
from models.kernels import Kernels
from models.meta import on_meta
from protocols.model_spec import ModelArgs, spec_of
from slidedp.activations.policy import KEEP, ActivationPolicy, format_blocks
from slidedp.activations.segments import BlockSegments, block_input

PROBE_SHAPES = ((1, 128), (1, 256), (2, 128))
"""(batch, seq) of the probes: sequence lengths that are multiples of every SDPA kernel's tile."""


@dataclass(frozen=True)
class Bytes:
    """Bytes of one block for a micro-batch of `batch` sequences of `seq` tokens."""

    per_token: float
    """Grows with every token (the activations)."""
    per_position: float
    """Grows with the sequence length, not the batch (the RoPE tables cast for the block)."""
    fixed: float
    """Per micro-batch (RNG seeds and the like)."""

    def at(self, batch: int, seq: int) -> int:
        return math.ceil(self.per_token * batch * seq + self.per_position * seq + self.fixed)

    @classmethod
    def fit(cls, measured: list[float]) -> "Bytes":
        """Through the values measured at PROBE_SHAPES."""
        (y0, y1, y2), ((_, s1), (_, s2), _) = measured, PROBE_SHAPES
        per_token = (y2 - y0) / s1
        per_position = (y1 - y0) / (s2 - s1) - per_token
        return cls(per_token, per_position, y0 - (per_token + per_position) * s1)

    def scaled(self, f: float) -> "Bytes":
        return Bytes(f * self.per_token, f * self.per_position, f * self.fixed)

    def __add__(self, other: "Bytes") -> "Bytes":
        return Bytes(self.per_token + other.per_token, self.per_position + other.per_position,
                     self.fixed + other.fixed)


@dataclass(frozen=True)
class BlockCost:
    """One block under one policy."""

    policy: str
    """The policy's name."""
    replays: str
    """What its backward recomputes."""
    gpu: Bytes
    """GPU bytes the block keeps from its forward to its backward."""
    host: Bytes
    """Host bytes it offloads (at most; the offload pool is sized from it)."""
    forward_flops_per_token: float
    """The block's forward FLOPs per token at the measured sequence length."""
    replay_flops_per_token: float
    """Forward FLOPs its backward replays, per token at the measured sequence length."""


class _OutputsOf(TorchDispatchMode):
    """Records the storages of the outputs of `ops`: what SAC's cache keeps (the mode sits below
    SAC's, so it sees the ops SAC lets through)."""

    def __init__(self, ops: frozenset):
        super().__init__()
        self.ops, self.sizes = ops, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out


def _widen(q: torch.Size, kv: torch.Size) -> tuple[int, ...]:
    return (kv[0], q[1], *kv[2:])


# torch.utils.flop_counter is imported where it counts: it imports triton (~0.15 s), which a
# process that only checks its config or runs another mode never needs.
def _gqa_sdpa_forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils import flop_counter

    return flop_counter.sdpa_flop_count(q, _widen(q, k), _widen(q, v))


def _gqa_sdpa_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    from torch.utils import flop_counter

    return flop_counter.sdpa_backward_flop_count(grad_out, q, _widen(q, k), _widen(q, v))


_aten = torch.ops.aten
GQA_SDPA_FLOPS = {
    **dict.fromkeys((_aten._scaled_dot_product_cudnn_attention,
                     _aten._scaled_dot_product_flash_attention,
                     _aten._scaled_dot_product_efficient_attention), _gqa_sdpa_forward),
    **dict.fromkeys((_aten._scaled_dot_product_cudnn_attention_backward,
                     _aten._scaled_dot_product_flash_attention_backward,
                     _aten._scaled_dot_product_efficient_attention_backward), _gqa_sdpa_backward)}
"""FlopCounterMode formulas for the fused SDPA ops with grouped-query attention: torch before
2.13 asserts that k and v have the query's heads (with enable_gqa they have fewer); the kernels
broadcast them, so count them widened, as torch 2.13 does."""


@dataclass(frozen=True)
class _Probe:
    hooked: int
    """Bytes of the storages saved through autograd's hooks."""
    cached: int
    """Bytes of the op outputs SAC caches, not also hooked."""
    forward_flops: int
    backward_flops: int


def _probe(policy: ActivationPolicy, block: nn.Module, args: ModelArgs,
           shape: tuple[int, int], device: torch.device) -> _Probe:
    from torch.utils.flop_counter import FlopCounterMode

    weights = dict(block.named_parameters())
    batch, seq = shape
    rope = spec_of(args).rope_tables(args, seq, device)
    h = torch.randn(batch, seq, args.dim, device=device, dtype=torch.bfloat16)
    grads: list[torch.Tensor] = []
    with (SavedStorages(exclude=weights.values()) as saved, _OutputsOf(policy.cached_ops) as sac,
          FlopCounterMode(display=False, custom_mapping=GQA_SDPA_FLOPS) as forward):
        out = policy.forward(BlockSegments(block), block_input(h, grads), weights, rope)
    with FlopCounterMode(display=False, custom_mapping=GQA_SDPA_FLOPS) as backward:
        out.backward(torch.ones_like(out))
    for w in weights.values():
        w.grad = None
    cached = sum(n for ptr, n in sac.sizes.items() if ptr not in saved.sizes)
    return _Probe(saved.nbytes, cached, forward.get_total_flops(), backward.get_total_flops())


def _per_token_at(f1: float, f2: float, seq: int) -> float:
    """f / s at `seq` for FLOPs per sequence f = a * s + b * s^2 through the one-sequence probes."""
    (_, s1), (_, s2) = PROBE_SHAPES[:2]
    b = (f2 / s2 - f1 / s1) / (s2 - s1)
    return f1 / s1 + b * (seq - s1)


def measure_costs(policies: Iterable[ActivationPolicy], args: ModelArgs, kernels: Kernels, *,
                  device: torch.device, seq_len: int) -> dict[ActivationPolicy, BlockCost]:
    """Each policy's BlockCost for one block of `args` on `kernels` and `device`."""
    with on_meta():
        block = spec_of(args).block_cls(args, kernels).to(torch.bfloat16)
    block = block.to_empty(device=device)
    # The probes draw random weights and inputs without moving the run's generators.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _measure(policies, block, args, device=device, seq_len=seq_len)


def _measure(policies: Iterable[ActivationPolicy], block: nn.Module, args: ModelArgs, *,
             device: torch.device, seq_len: int) -> dict[ActivationPolicy, BlockCost]:
    with torch.no_grad():
        for name, p in block.named_parameters():
            spec_of(args).init_parameter(name, p)
    probes: dict[ActivationPolicy, list[_Probe]] = {}  # by policy without offload

    def runs_of(policy: ActivationPolicy) -> list[_Probe]:
        base = replace(policy, offload=0.0)
        if base not in probes:
            probes[base] = [_probe(base, block, args, shape, device) for shape in PROBE_SHAPES]
        return probes[base]

    keep = runs_of(KEEP)
    costs = {}
    for policy in set(policies):
        runs = runs_of(policy)
        hooked = Bytes.fit([r.hooked for r in runs])
        cached = Bytes.fit([r.cached for r in runs])
        host, gpu = hooked.scaled(policy.offload), hooked.scaled(1 - policy.offload) + cached
        replay = [r.backward_flops - k.backward_flops for r, k in zip(runs[:2], keep)]
        costs[policy] = BlockCost(
            policy=policy.name, replays=policy.replays, gpu=gpu, host=host,
            forward_flops_per_token=_per_token_at(*(k.forward_flops for k in keep[:2]), seq_len),
            replay_flops_per_token=_per_token_at(*replay, seq_len))
    return costs


def offload_bytes(policies: list[ActivationPolicy], costs: dict[ActivationPolicy, BlockCost],
                  batch: int, seq: int) -> int:
    """Host bytes the blocks offload in one micro-batch of `batch` x `seq` tokens (at most)."""
    return sum(costs[p].host.at(batch, seq) for p in policies if p.offload)


def describe_costs(policies: list[ActivationPolicy], costs: dict[ActivationPolicy, BlockCost],
                   batch: int, seq: int) -> str:
    """Each policy's bytes per block for a micro-batch and what it replays; which blocks use it."""
    lines = [f"[slidedp] activations per block for {batch} x {seq} tokens per micro-batch "
             f"(measured on one block):"]
    for policy in dict.fromkeys(policies):
        cost = costs[policy]
        host = cost.host.at(batch, seq)
        replay = cost.replay_flops_per_token / cost.forward_flops_per_token
        lines.append(f"  {policy.name}: {cost.gpu.at(batch, seq) / 2**20:.1f} MiB GPU"
                     f"{f' + {host / 2**20:.1f} MiB host' if host else ''}; replays "
                     f"{cost.replays} (+{replay:.0%} of the forward FLOPs)")
    lines.append(f"  blocks {format_blocks(policies)}")
    return "\n".join(lines)
