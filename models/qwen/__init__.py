"""Qwen3 and Qwen2.5: flavors, the decoder, its block's anatomy and its Hugging Face adapter."""

from models.qwen.args import QwenArgs
from models.qwen.flavors import FLAVORS, PUBLISHED_BILLIONS
from models.qwen.hf_adapter import QwenHFAdapter
from models.qwen.model import (BLOCK_SEGMENTS, QwenModel, StreamedHead, TransformerBlock, embed,
                               init_parameter, units)
from models.qwen.segments import FLOPS, SAVED
from models.rope import rope_tables
from protocols.model_spec import ModelSpec

__all__ = ["FLAVORS", "QwenArgs", "QwenModel", "TransformerBlock", "model_spec"]


def model_spec() -> ModelSpec:
    """Qwen's spec, as models.SUPPORTED_MODELS registers it."""
    return ModelSpec(name="qwen", families=("qwen3", "qwen2.5"), args_cls=QwenArgs,
                     model_cls=QwenModel, block_cls=TransformerBlock, flavors=FLAVORS,
                     published_billions=PUBLISHED_BILLIONS, segments=BLOCK_SEGMENTS, saved=SAVED,
                     flops=FLOPS, units=units, embed=embed, head_loss=StreamedHead,
                     init_parameter=init_parameter, rope_tables=rope_tables,
                     hf=QwenHFAdapter())
