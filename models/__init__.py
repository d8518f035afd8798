"""Qwen3 and Qwen2.5 model definitions, flavors, the chunked loss and Hugging Face checkpoint I/O."""

from models.args import QwenArgs
from models.flavors import FLAVORS, get_flavor
from models.qwen import QwenModel, TransformerBlock

__all__ = ["FLAVORS", "QwenArgs", "QwenModel", "TransformerBlock", "get_flavor"]
