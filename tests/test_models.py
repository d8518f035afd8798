"""Every flavor: published architecture, parameter count, shapes; blocks are separable units."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.loss import IGNORE_INDEX, chunked_cross_entropy_sum
from models.meta import on_meta
from models.rope import rope_tables
from protocols.model_spec import ModelArgs, get_flavor, get_model_spec

QWEN = get_model_spec("qwen")
PUBLISHED = sorted(QWEN.published_billions)


def meta_model(args: ModelArgs) -> nn.Module:
    with on_meta():
        return QWEN.model_cls(args)


@pytest.mark.parametrize("name", ["qwen3-debug", "qwen2.5-debug"])
def test_a_meta_build_has_the_parameters_of_a_real_one(name):
    args = get_flavor(name)
    meta, real = meta_model(args), QWEN.model_cls(args)
    assert {n: (p.shape, p.dtype) for n, p in meta.named_parameters()} == {
        n: (p.shape, p.dtype) for n, p in real.named_parameters()}
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    with on_meta():  # a module placed elsewhere on purpose keeps its init
        torch.manual_seed(0)
        placed = nn.Linear(8, 4, device="cpu")
    torch.manual_seed(0)
    assert torch.equal(placed.weight, nn.Linear(8, 4).weight)


def _imports_dynamo(build: str) -> bool:
    code = ("import sys, torch; from models.meta import on_meta; "
            "from protocols.model_spec import get_flavor, get_model_spec; "
            f"args = get_flavor('qwen3-debug')\nwith {build}: get_model_spec('qwen').model_cls(args)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_a_meta_build_skips_the_init_that_imports_dynamo():
    """A shape-only build (the launcher's host-memory check, the runtime's block shapes) does
    not pay for nn.init on meta tensors: its first random fill imports torch._dynamo."""
    if not _imports_dynamo('torch.device("meta")'):
        pytest.skip("this torch's meta init does not import torch._dynamo")
    assert not _imports_dynamo("on_meta()")


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_matches_the_model_card(name):
    args = get_flavor(name)
    model = meta_model(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == args.num_params()
    # Model cards round to 2-3 digits ("1.7B" for 1.72B); Qwen2.5-32B's says 32.5B for 32.76B.
    assert counted / 1e9 == pytest.approx(QWEN.published_billions[name], rel=0.011, abs=0.03)


@pytest.mark.parametrize("name", PUBLISHED)
def test_family_features_and_shapes(name):
    args = get_flavor(name)
    model = meta_model(args)
    attn = model.layers[0].self_attn
    qwen3 = args.family == "qwen3"
    assert (attn.q_norm is not None) == qwen3 and (attn.q_proj.bias is None) == qwen3
    assert attn.q_proj.weight.shape == (args.n_heads * args.head_dim, args.dim)
    assert attn.k_proj.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert model.layers[0].mlp.up_proj.weight.shape == (args.hidden_dim, args.dim)
    assert len(model.layers) == args.n_layers
    assert (model.lm_head is None) == args.tie_embeddings
    assert model.head_weight().shape == (args.vocab_size, args.dim)


def test_published_architectures_spot_checks():
    q8, q72 = get_flavor("qwen3-8B"), get_flavor("qwen2.5-72B")
    assert (q8.dim, q8.n_layers, q8.n_heads, q8.n_kv_heads, q8.hidden_dim) == (4096, 36, 32, 8, 12288)
    assert (q72.dim, q72.n_layers, q72.n_heads, q72.n_kv_heads, q72.hidden_dim) == (8192, 80, 64, 8, 29568)
    assert q72.vocab_size == 152064 and get_flavor("qwen3-0.6B").tie_embeddings
    assert not get_flavor("qwen2.5-7B").tie_embeddings and get_flavor("qwen2.5-3B").tie_embeddings


def test_unknown_flavor_names_the_choices():
    with pytest.raises(ValueError, match="qwen3-8B"):
        get_flavor("qwen3-9B")


@pytest.mark.parametrize("name", ["qwen3-debug", "qwen2.5-debug"])
def test_blocks_are_separable_units(name):
    """Running the blocks one by one, each with only its own parameters and the RoPE tables,
    reproduces the model's forward: what the streaming runtime relies on."""
    args = get_flavor(name)
    torch.manual_seed(0)
    model = QWEN.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    cos, sin = rope_tables(args, 24, "cpu")
    h = model.embed_tokens(tokens)
    for block in model.layers:
        assert not list(block.buffers())
        standalone = QWEN.block_cls(args)
        standalone.load_state_dict(block.state_dict())
        h = standalone(h, cos, sin)
    torch.testing.assert_close(model.norm(h), model(tokens))


def test_chunked_loss_equals_full_cross_entropy_with_masks():
    args = get_flavor("qwen2.5-debug")
    torch.manual_seed(0)
    model = QWEN.model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (3, 20))
    labels = tokens.roll(-1, dims=1)
    labels[:, :5] = IGNORE_INDEX
    hidden = model(tokens)
    logits = (hidden @ model.head_weight().T).reshape(-1, args.vocab_size)
    full = F.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    chunked = chunked_cross_entropy_sum(hidden, model.head_weight(), labels, chunk_tokens=7)
    torch.testing.assert_close(chunked, full)
    g_full = torch.autograd.grad(full, model.lm_head.weight, retain_graph=True)[0]
    g_chunk = torch.autograd.grad(chunked, model.lm_head.weight)[0]
    torch.testing.assert_close(g_chunk, g_full)
