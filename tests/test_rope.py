"""RoPE scaling (models/rope.py) against transformers' definition (`ROPE_INIT_FUNCTIONS`), its
config.json form, and the positions a model takes."""

import dataclasses
import math

import pytest
import torch

from models.hf_checkpoint import args_from_hf_config, to_hf_config
from models.rope import (RopeScaling, inv_frequencies, rope_scaling_from_hf, rope_scaling_to_hf,
                         rope_tables)
from protocols.model_spec import ModelArgs, get_model_spec

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

QWEN3_CARD_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
_HALF = 64  # head_dim / 2 of the published flavors
# (flavor, config.json rope_scaling, sequence lengths to compare at)
CASES = [
    ("qwen3-8B", {"rope_type": "linear", "factor": 4.0}, [4096]),
    ("qwen3-8B", {"rope_type": "dynamic", "factor": 4.0}, [4096, 40960, 100_000]),
    ("qwen2.5-7B", {"type": "dynamic", "factor": 2.0}, [200_000]),
    ("qwen3-8B", QWEN3_CARD_YARN, [4096]),
    ("qwen3-4B", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768},
     [262_144]),
    ("qwen2.5-7B", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     [4096]),
    ("qwen3-8B", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                  "attention_factor": 0.9, "beta_fast": 16, "beta_slow": 2, "truncate": False},
     [4096]),
    ("qwen3-8B", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "mscale": 1.0, "mscale_all_dim": 0.707}, [4096]),
    ("qwen3-8B", {"rope_type": "yarn", "original_max_position_embeddings": 8192}, [4096]),
    ("qwen3-8B", {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                  "short_factor": [1.0 + i / 100 for i in range(_HALF)],
                  "long_factor": [1.0 + i / 10 for i in range(_HALF)]}, [4096, 8000]),
    ("qwen3-8B", {"rope_type": "longrope", "original_max_position_embeddings": 4096, "factor": 8.0,
                  "short_factor": [1.0] * _HALF, "long_factor": [2.0] * _HALF}, [8000]),
    ("qwen3-8B", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, [4096]),
]

QWEN = get_model_spec("qwen")


def with_scaling(flavor: str, rope_scaling: dict) -> ModelArgs:
    """The flavor read back from its config.json with `rope_scaling` set."""
    return args_from_hf_config({**to_hf_config(QWEN.flavors[flavor]), "rope_scaling": rope_scaling})


def hf_config(args: ModelArgs):
    cls = transformers.Qwen3Config if args.family == "qwen3" else transformers.Qwen2Config
    return cls(**to_hf_config(args))


@pytest.mark.parametrize("flavor, rope_scaling, seq_lens", CASES,
                         ids=[f"{c[1].get('rope_type', c[1].get('type'))}-{i}"
                              for i, c in enumerate(CASES)])
def test_frequencies_equal_transformers(flavor, rope_scaling, seq_lens):
    args = with_scaling(flavor, rope_scaling)
    config = hf_config(args)
    init = ROPE_INIT_FUNCTIONS[args.rope_scaling.rope_type]
    for seq_len in seq_lens:
        theirs, their_factor = init(config, "cpu", seq_len=seq_len)
        ours, our_factor = inv_frequencies(args, seq_len=seq_len, device="cpu")
        assert ours.dtype == torch.float32 and ours.shape == (args.head_dim // 2,)
        torch.testing.assert_close(ours, theirs.float(), rtol=2e-6, atol=0)
        assert our_factor == pytest.approx(float(their_factor), rel=1e-12)
        # The scaling changes something: frequencies or the factor on cos and sin.
        plain, _ = inv_frequencies(dataclasses.replace(args, rope_scaling=None),
                                   seq_len=seq_len, device="cpu")
        dynamic_short = args.rope_scaling.rope_type == "dynamic" and \
            seq_len <= args.max_position_embeddings
        assert (not torch.equal(ours, plain) or our_factor != 1.0) != dynamic_short


def test_default_frequencies_equal_transformers():
    args = QWEN.flavors["qwen3-8B"]
    config = hf_config(args)
    theirs, factor = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding \
        .compute_default_rope_parameters(config)
    ours, our_factor = inv_frequencies(args, seq_len=4096, device="cpu")
    assert torch.equal(ours, theirs) and our_factor == factor == 1.0


def test_yarn_attention_factor_scales_cos_and_sin():
    args = with_scaling("qwen3-debug", {**QWEN3_CARD_YARN, "factor": 8.0})
    cos, sin = rope_tables(args, 16, "cpu")
    mscale = 0.1 * math.log(8.0) + 1.0
    # cos² + sin² = mscale² at every position and frequency.
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, mscale**2))


def test_qwen_model_card_dict_round_trips():
    scaling = rope_scaling_from_hf({"rope_scaling": QWEN3_CARD_YARN},
                                   max_position_embeddings=40960, origin="config.json")
    assert scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)
    assert rope_scaling_to_hf(scaling) == QWEN3_CARD_YARN
    # Qwen2.5's cards spell the type "type"; transformers 5 nests it in rope_parameters.
    for cfg in ({"rope_scaling": {**QWEN3_CARD_YARN, "type": "yarn"}},
                {"rope_parameters": {**QWEN3_CARD_YARN, "rope_theta": 1e6}}):
        assert rope_scaling_from_hf(cfg, max_position_embeddings=32768, origin="c") == scaling
    for cfg in ({}, {"rope_scaling": None}, {"rope_parameters": {"rope_type": "default"}}):
        assert rope_scaling_from_hf(cfg, max_position_embeddings=32768, origin="c") is None


def test_positions_a_model_takes():
    qwen3 = QWEN.flavors["qwen3-8B"]
    assert qwen3.max_positions() == 40960 and qwen3.rope_scaling is None
    assert with_scaling("qwen3-8B", QWEN3_CARD_YARN).max_positions() == 131_072
    yarn8 = with_scaling("qwen3-8B", {**QWEN3_CARD_YARN, "factor": 8.0})
    assert yarn8.max_positions() == 262_144
    assert yarn8.describe_positions() == "262,144 positions (RoPE yarn x8 over 32,768)"
    # Linear and dynamic scale max_position_embeddings.
    assert with_scaling("qwen2.5-7B", {"type": "linear", "factor": 2.0}).max_positions() == 65_536
    # A scaling never takes away the positions the config declares.
    assert with_scaling("qwen3-8B", {**QWEN3_CARD_YARN, "factor": 1.0}).max_positions() == 40960


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "su", "factor": 2.0}, "rope scaling 'su' is not supported"),
    ({"rope_type": "linear"}, "linear needs a factor"),
    ({"rope_type": "linear", "factor": "4"}, "factor must be a number, got '4'"),
    ({"rope_type": "linear", "factor": 0.5}, "factor must be >= 1"),
    ({**QWEN3_CARD_YARN, "original_max_position_embeddings": 1.5}, "must be an integer"),
    ({**QWEN3_CARD_YARN, "truncate": 1}, "truncate must be true or false"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     "llama3 scaling needs high_freq_factor"),
    ({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [1.0]},
     "longrope short_factor needs head_dim / 2 = 64 values, got 1"),
    ({**QWEN3_CARD_YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_bad_rope_scaling_is_one_line(rope_scaling, message):
    with pytest.raises(ValueError, match=message) as info:
        with_scaling("qwen3-8B", rope_scaling)
    assert "\n" not in str(info.value)


def test_fields_a_type_does_not_read_are_refused():
    with pytest.raises(ValueError, match="linear scaling takes no beta_fast"):
        RopeScaling("linear", 2.0, beta_fast=8.0)
    with pytest.raises(ValueError, match="yarn scaling needs original_max_position_embeddings"):
        RopeScaling("yarn", 2.0)
