"""Per-block activation policies and what carries them out.

  policy.py       the policies as objects (keep, recompute, segment masks, op-level saves, offload
                  fractions), their written form and the per-block [slidedp] keys
  segments.py     running a block's segments on streamed weights; the block input tap
  cost.py         each policy's GPU and host bytes and replay FLOPs, measured on one block
  offload.py      saved activations to pinned host memory and back, on a stream of their own
  weight_refs.py  the saved-tensor hooks of a block: weights as references, the rest offloaded
"""

from slidedp.activations.cost import BlockCost, Bytes, describe_costs, measure_costs, offload_bytes
from slidedp.activations.offload import Offloader
from slidedp.activations.policy import (KEEP, RECOMPUTE, SELECTIVE, ActivationPolicy, SavedOps,
                                        SegmentMask, block_policies, format_blocks, parse_policy)
from slidedp.activations.segments import BlockSegments, as_streamed, block_input
from slidedp.activations.weight_refs import WeightRefs

__all__ = ["KEEP", "RECOMPUTE", "SELECTIVE", "ActivationPolicy", "BlockCost", "BlockSegments",
           "Bytes", "Offloader", "SavedOps", "SegmentMask", "WeightRefs", "as_streamed",
           "block_input", "block_policies", "describe_costs", "format_blocks", "measure_costs",
           "offload_bytes", "parse_policy"]
