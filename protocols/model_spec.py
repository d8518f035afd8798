"""The model seam: what the runtime, the planner and the recipes ask of a model family.

Each `models/<name>/` package returns one `ModelSpec` from `model_spec()`; `models.SUPPORTED_MODELS`
lists the packages (one line per family). Everything outside `models/` reaches a model through
these lookups: a flavor name (the config's `model.flavor`) or a config.json's `model_type` finds
its spec, and a spec's args find theirs again by `family`.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Any, Protocol

import torch
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]
UnitParams = list[tuple[str, str, torch.Size]]
"""A unit's parameters: (full name, name inside the unit's module, shape), in flat order."""


class ModelArgs(Protocol):
    """The hyper-parameters of one flavor, as the runtime, the planner and the recipes read them
    (a family's own, e.g. its MLP width, stay with its spec)."""

    family: str
    """Finds the flavor's spec again (`spec_of`)."""
    dim: int
    """Width of the residual stream (the embedding's columns)."""
    n_layers: int
    """Transformer blocks: the units between the embedding and the head."""
    n_heads: int
    """Query heads (attention FLOPs, the SDPA kernel choice)."""
    n_kv_heads: int
    """Key/value heads (the SDPA kernel choice)."""
    head_dim: int
    """Per-head size (RoPE tables, attention FLOPs)."""
    vocab_size: int
    """Embedding rows and head width (the loss chunk's logits)."""
    tie_embeddings: bool
    """The head is the embedding (no head weight of its own)."""
    rope_theta: float
    """RoPE base frequency."""
    max_position_embeddings: int
    """The published context (what RoPE scalings stretch)."""
    rope_scaling: Any
    """A models/rope.py RopeScaling, or None."""

    def max_positions(self) -> int: ...

    def describe_positions(self) -> str: ...

    def block_params(self) -> int: ...

    def num_params(self) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...


class HFAdapter(Protocol):
    """A family's Hugging Face checkpoint format: its config.json and its tensor names."""

    model_types: tuple[str, ...]
    """The config.json `model_type` values it reads."""
    head: str
    """The model's name of the output head, which a tied checkpoint omits."""

    def to_hf_name(self, name: str) -> str: ...

    def from_hf_name(self, key: str) -> str: ...

    def args_from_hf_config(self, cfg: dict[str, Any], *, origin: str) -> ModelArgs: ...

    def to_hf_config(self, args: ModelArgs, *, dtype: torch.dtype,
                     source_config: dict[str, Any] | None) -> dict[str, Any]: ...


class HeadLoss(Protocol):
    """(head weights, embedding weights, hidden states, labels, chunk_tokens) -> the sum of the
    token losses; weights by their name inside the unit."""

    def __call__(self, head: dict[str, torch.Tensor], embed: dict[str, torch.Tensor],
                 h: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class SavedTensors:
    """What a block's forward may save for backward, segment by segment (counted from the code;
    slidedp/plan/memory.py turns it into bytes)."""

    tensors: Mapping[str, tuple[str, bool]]
    """name -> (width key of `widths`, FP32: else the compute dtype); one name is one storage.
    Width "tables" is per position, every other per token."""
    widths: Callable[[ModelArgs], dict[str, int]]
    """The elements of each width key for a flavor."""
    inputs: Mapping[str, tuple[str, ...]]
    """segment -> the tensors it takes (the residual rides along)."""
    saves: Callable[[ModelArgs, str], dict[str, frozenset[str]]]
    """(args, kernels "torch" or "liger") -> segment -> what its ops save when it is kept."""
    op_outputs: Mapping[str, tuple[str, ...]]
    """The outputs of each op class of slidedp/activations/policy.py's OP_CLASSES, in forward
    order."""


@dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs of a block's segments (backward counts twice its forward)."""

    per_token: Callable[[ModelArgs, int], dict[str, float]]
    """(args, seq) -> segment -> forward FLOPs per token at that sequence length."""
    attention: str
    """The segment that is the attention core (timed apart where a rate is measured)."""
    terminal_linears: frozenset[str]
    """Segments ending in a projection whose output backward does not need, so a replayed run
    ending in one stops before it."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family: its classes, flavors, block anatomy, units and checkpoint format."""

    name: str
    """The package under models/ (e.g. "qwen")."""
    families: tuple[str, ...]
    """The `family` values of its args."""
    args_cls: type
    """The flavor dataclass."""
    model_cls: Callable[..., nn.Module]
    """(args, kernels) -> the whole model: `forward(tokens)` the final hidden states,
    `loss_sum(hidden, labels, chunk_tokens=)`, `init_weights()`, and its blocks as `layers`
    (the baselines shard and checkpoint them one by one)."""
    block_cls: Callable[..., nn.Module]
    """(args, kernels) -> one transformer block: `forward(x, cos, sin)`,
    `run_segments(names, state, cos, sin)` and `segments` (= `segments` below), the unit that
    SlideDP streams."""
    flavors: Mapping[str, ModelArgs]
    """Named architectures, tiny debug ones included."""
    published_billions: Mapping[str, float]
    """Parameter counts of the published flavors from their model cards (billions)."""
    segments: tuple[str, ...]
    """A block's forward, in order (the activation policies keep or replay them one by one)."""
    saved: SavedTensors
    flops: BlockFlops
    units: Callable[[ModelArgs], list[tuple[str, UnitParams]]]
    """(kind "embed", "block" or "head", its parameters) in forward order."""
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    """(embedding unit weights, tokens) -> the first block's input."""
    head_loss: Callable[..., HeadLoss]
    """(args, kernels) -> the head's step: final norm, output projection and loss."""
    init_parameter: Callable[..., None]
    """(name, tensor, *, generator=None): one parameter's random init in place, as
    `model_cls(...).init_weights()` draws it."""
    rope_tables: Callable[[ModelArgs, int, torch.device | str], Rope]
    """(args, seq_len, device) -> the cos and sin tables every block takes."""
    hf: HFAdapter


@cache
def get_model_spec(name: str) -> ModelSpec:
    """The spec of models/<name>/."""
    from models import SUPPORTED_MODELS  # below models/: import it only when asked

    if name not in SUPPORTED_MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SUPPORTED_MODELS)}")
    return import_module(f"models.{name}").model_spec()


def model_specs() -> list[ModelSpec]:
    """Every registered spec."""
    from models import SUPPORTED_MODELS

    return [get_model_spec(name) for name in SUPPORTED_MODELS]


def all_flavors() -> dict[str, ModelArgs]:
    """Every flavor of every spec, by name (names are unique across specs)."""
    return {name: args for spec in model_specs() for name, args in spec.flavors.items()}


def spec_of_flavor(flavor: str) -> ModelSpec:
    """The spec with that flavor, with the list of valid names in the error."""
    for spec in model_specs():
        if flavor in spec.flavors:
            return spec
    raise ValueError(f"unknown model flavor {flavor!r}; choose one of {sorted(all_flavors())}")


def get_flavor(flavor: str) -> ModelArgs:
    """A flavor's args by name."""
    return spec_of_flavor(flavor).flavors[flavor]


def known_segments() -> tuple[str, ...]:
    """Every registered block's segments, in the order they first appear."""
    return tuple(dict.fromkeys(s for spec in model_specs() for s in spec.segments))


def spec_of(args: ModelArgs) -> ModelSpec:
    """The spec whose flavors `args` is one of (found by its family)."""
    for spec in model_specs():
        if args.family in spec.families:
            return spec
    raise ValueError(f"no model spec has family {args.family!r}")


def spec_of_model_type(model_type: Any, *, origin: str) -> ModelSpec:
    """The spec that reads a config.json of that `model_type`."""
    known = {t: spec for spec in model_specs() for t in spec.hf.model_types}
    if model_type not in known:
        raise ValueError(f"{origin}: unsupported model_type {model_type!r} "
                         f"(expected one of {sorted(known)})")
    return known[model_type]
