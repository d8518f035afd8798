"""Cross-entropy that never materializes the full (tokens x vocab) logits.

The head is applied to `chunk_tokens` rows at a time; each chunk's logits are recomputed in
backward (activation checkpointing of the chunk), so peak memory is one chunk of logits.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                              *, chunk_tokens: int = 4096) -> torch.Tensor:
    """Sum of token losses (labels == IGNORE_INDEX excluded). Divide by the global count of
    target tokens yourself: that keeps gradient accumulation and data parallelism exact."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        hs, ys = h[start:start + chunk_tokens], y[start:start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, hs, head_weight, ys, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(hs, head_weight, ys)
    return total
