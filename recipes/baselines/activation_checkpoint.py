"""Activation checkpointing of the GPU-resident baselines (`single`, `fsdp2`, the compute
reference): torchtitan's options `none`, `full` and `selective` with its op-level policy.

- "full": every transformer block is recomputed in backward (non-reentrant); forward saves only
  the block's input.
- "selective": torchtitan 0.2.2's per-op selective activation checkpointing (`mode =
  "selective"`, `selective_ac_option = "op"`): each block is recomputed in backward, except that
  forward saves the outputs of the ops in OP_SAC_SAVE_LIST, all but every second matmul of the
  block (the rule of torchtitan's `_apply_op_sac`); the pointwise ops (norms, RoPE, SwiGLU, the
  residual adds) are recomputed. For a Qwen3 block that saves q, v, gate and down projections
  (k, o and up are recomputed) and the attention kernel's outputs.

torchtitan's `apply_ac` does not fit our model as it is: it replaces each block with a
`CheckpointWrapper` module, which renames every block parameter in `model.named_parameters()`
(`layers.N._checkpoint_wrapped_module.…`), the names our Hugging Face export, sharded init and
checkpoint loads go by. So the same policies are applied here to each block's `forward` (torch's
non-reentrant checkpoint, and for "selective" torch's `create_selective_checkpoint_contexts`, as
torchtitan's code does), which leaves the modules and their names as they are. Like torchtitan's
wrapper, the checkpointed region is the block's forward alone, inside the module call: FSDP2's
hooks on the block (all-gathers, record_function markers) stay outside it, where op-level
checkpointing needs them (forward and replay must run the same ops).

With the liger kernels ([model] kernels, models/kernels.py) RMSNorm, RoPE and SwiGLU are Triton
autograd Functions, not aten ops: op-level checkpointing cannot see them, so they are always
replayed in backward (as they are under "full"); only the matmul and attention outputs are saved.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from slidedp.run_config import ACMode

_aten = torch.ops.aten

MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default})
"""The matmuls torchtitan's policy counts (every second one is recomputed). torchtitan's list
has mm only, its models having no biases; Qwen2.5's biased q/k/v projections run as addmm, so
addmm is counted too, to give both families the same saves."""

OP_SAC_SAVE_LIST = MATMUL_OPS | {
    # torchtitan 0.2.2's _op_sac_save_list (torchtitan/models/qwen3/infra/parallelize.py), the
    # ops of it our model runs; its reduce_scatter, max, flex and varlen entries never occur here.
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    # The CPU's SDPA kernel (not in torchtitan's GPU list): the CPU runs the same policy.
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""aten ops whose outputs the selective policy saves (matmuls: every other one)."""


def op_sac_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's op-level policy for one block's forward (and, counted apart, its replay):
    save the outputs of OP_SAC_SAVE_LIST except every second matmul, recompute the rest."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute: the replay must decide as forward did

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMUL_OPS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in OP_SAC_SAVE_LIST:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_contexts():
    return create_selective_checkpoint_contexts(op_sac_policy())


def _checkpointed(forward: Callable[..., torch.Tensor], *args: torch.Tensor,
                  selective: bool) -> torch.Tensor:
    kwargs = {"context_fn": _op_sac_contexts} if selective else {}
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, *, mode: ACMode) -> None:
    """`mode` on every block of `model.layers`, in place (modules and parameter names
    unchanged): each block's forward runs under the checkpoint, its hooks outside."""
    if mode == "none":
        return
    for block in model.layers:
        block.forward = partial(_checkpointed, block.forward, selective=mode == "selective")
