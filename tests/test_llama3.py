"""Llama 3 through the model seam: Hugging Face safetensors in and out, and logits equal to
transformers' LlamaForCausalLM on the CPU (SlideDP against `single`: test_slidedp.py)."""

import dataclasses
from pathlib import Path

import pytest
import torch

from models.hf_checkpoint import (args_from_hf_config, load_hf_into_model, match_flavor,
                                  read_hf_config, save_hf_checkpoint, to_hf_config)
from protocols.model_spec import get_flavor, get_model_spec, spec_of

transformers = pytest.importorskip("transformers")

LLAMA = get_model_spec("llama3")
# Llama 3's scaling over a short original context, so a 48-token sequence crosses both bounds.
ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def hf_llama(*, tied: bool) -> "transformers.LlamaForCausalLM":
    """A tiny LlamaForCausalLM with random weights (norms too, so none is trivially 1)."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=tied, rope_parameters=dict(ROPE))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1 if p.dim() == 1 else 0.02).add_(1.0 if p.dim() == 1 else 0.0)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hugging_face_llama_round_trips_and_gives_the_same_logits(tmp_path: Path, tied: bool):
    """LlamaForCausalLM's save_pretrained loads into our model with its config (llama3 RoPE
    scaling, tying); our logits equal transformers' in FP32; our save loads back into
    transformers with the same tensors."""
    hf = hf_llama(tied=tied)
    hf.save_pretrained(tmp_path / "theirs")
    args = read_hf_config(tmp_path / "theirs")
    assert spec_of(args) is LLAMA
    assert (args.tie_embeddings, args.qk_norm, args.qkv_bias) == (tied, False, False)
    assert args.rope_scaling.rope_type == "llama3" and args.rope_scaling.factor == 4.0
    model = LLAMA.model_cls(args)
    load_hf_into_model(model, tmp_path / "theirs")

    unscaled = LLAMA.model_cls(dataclasses.replace(args, rope_scaling=None))
    unscaled.load_state_dict(model.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens) @ model.head_weight().T
        theirs = hf(tokens).logits
        plain = unscaled(tokens) @ unscaled.head_weight().T
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, theirs, atol=1e-3, rtol=0)  # the llama3 scaling counted

    save_hf_checkpoint(model.named_parameters(), args, tmp_path / "ours", dtype=torch.float32,
                       max_shard_bytes=2**16)  # sharded, with an index
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").float()
    assert back.config.tie_word_embeddings == tied
    assert back.config.rope_parameters["rope_type"] == "llama3"
    mine, want = back.state_dict(), hf.state_dict()
    assert mine.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(mine[name], tensor), name
    assert read_hf_config(tmp_path / "ours") == args


@pytest.mark.parametrize("flavor", sorted(LLAMA.published_billions))
def test_published_flavors_match_their_model_cards(flavor: str):
    """Parameter counts of the built (meta) models and of the args; the HF config we write reads
    back as the same flavor."""
    args = get_flavor(flavor)
    with torch.device("meta"):
        model = LLAMA.model_cls(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == args.num_params()
    assert counted / 1e9 == pytest.approx(LLAMA.published_billions[flavor], abs=0.01)
    assert (model.lm_head is None) == flavor.startswith("llama3.2")
    back = args_from_hf_config(to_hf_config(args))
    assert back == args and match_flavor(back) == flavor
