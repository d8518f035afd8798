"""A block's segments run on weights of the caller's choosing, and the block's input as a tensor
that only the policy keeps."""

import torch
from torch import nn
from torch.func import functional_call



class _Segments(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, names, state, cos, sin):
        return self.block.run_segments(names, state, cos, sin)


class BlockSegments:
    """Runs a (meta-device) template block's run_segments (its ModelSpec's block_cls) with the
    given weights, through functional_call: no module owns the streamed weights."""

    def __init__(self, template: nn.Module):
        self._module = _Segments(template)
        self.names: tuple[str, ...] = template.segments
        """The block's segments, in forward order."""

    def __call__(self, names: tuple[str, ...], state: tuple[torch.Tensor, ...],
                 weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor]):
        params = {f"block.{name}": w for name, w in weights.items()}
        return functional_call(self._module, params, (names, state, *rope))


def as_streamed(block: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(flat, weights): copies of the block's parameters as leaf views of one flat buffer, the
    way SlideDP's GPU window holds a unit (for WeightRefs outside the engine: probes, benches)."""
    params = dict(block.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    weights, offset = {}, 0
    for name, p in params.items():
        weights[name] = flat[offset:offset + p.numel()].view(p.shape).requires_grad_()
        offset += p.numel()
    return flat, weights


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, anchor, sink):
        ctx.sink = sink
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(grad)
        return None, None, None


_ANCHOR = torch.empty(0, requires_grad=True)  # makes the tap's output require grad


def block_input(h: torch.Tensor, grad_sink: list[torch.Tensor]) -> torch.Tensor:
    """`h` (not requiring grad) as the input of a block's graph; backward appends its gradient to
    `grad_sink`. Unlike a leaf, whose AccumulateGrad node would hold it, nothing in the graph
    refers to this tensor: if only the policy saves it (and offloads it), it leaves the GPU."""
    return _Tap.apply(h, _ANCHOR, grad_sink)
