"""The two tensor collectives of the routes, under the running torch's name for them.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and the old names now warn (FutureWarning) at every call; torch 2.11 and
2.12 have only the old names. Same arguments, same semantics.
"""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_single(output, input, group=None): output is the ranks' inputs concatenated."""

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_single(output, input, group=None): output is rank r's slice of the sum."""
