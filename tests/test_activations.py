"""SlideDP's activation policies one block at a time: every segment mask and op-level policy is
exact, the offload data path gives the same gradients and frees what it moves, the start-up
measurement is right, and the written forms round-trip through a TOML file.

(Equality with `single` on real ranks, for every policy, mixes and offload fractions:
test_slidedp.py.)
"""

import itertools
import random

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.multiprocessing.reductions import StorageWeakRef

from models.activation_memory import SavedStorages
from models.kernels import TORCH_KERNELS
from models.rope import rope_tables
from protocols.model_spec import get_flavor, get_model_spec
from recipes.config import parse_config
from slidedp.activations import (KEEP, RECOMPUTE, SELECTIVE, BlockSegments, Offloader, SavedOps,
                                 SegmentMask, WeightRefs, as_streamed, block_input, block_policies,
                                 format_blocks, measure_costs, parse_policy)
from slidedp.streams import Streams
from slidedp.traffic import Traffic

QWEN = get_model_spec("qwen")
FAMILIES = ["qwen3-debug", "qwen2.5-debug"]
OPS = [SELECTIVE, SavedOps(ops=frozenset({"matmul"})),
       SavedOps(ops=frozenset({"matmul", "attention"}))]


def _block(flavor: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    block = QWEN.block_cls(get_flavor(flavor)).to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            QWEN.init_parameter(name, p)
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))  # not the trivial values
    return block


def _grads(block, run, x, g):
    """(output, input gradient, parameter gradients) of `run(h) -> out` with gradient g."""
    block.zero_grad(set_to_none=True)
    grad_in: list[torch.Tensor] = []
    out = run(block_input(x, grad_in))
    torch.autograd.backward(get_gradient_edge(out), g)
    return out.detach(), grad_in[0], {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize("flavor", FAMILIES)
def test_every_segment_mask_and_op_policy_gives_exactly_the_plain_gradients(flavor):
    block, args = _block(flavor), get_flavor(flavor)
    x = torch.randn(2, 24, args.dim)
    rope = rope_tables(args, 24, "cpu")
    g = torch.randn(2, 24, args.dim)
    ref = _grads(block, lambda h: block(h, *rope), x, g)
    weights = dict(block.named_parameters())
    # Every segment kept alone and replayed alone (so every boundary, either way, at every
    # position), all and none, and a fixed sample of the other masks.
    every = [frozenset(kept) for n in range(len(QWEN.segments) + 1)
             for kept in itertools.combinations(QWEN.segments, n)]
    chosen = [k for k in every if len(k) in (0, 1, 7, 8)]
    chosen += random.Random(0).sample([k for k in every if k not in chosen], 12)
    masks = [SegmentMask(kept=kept) for kept in chosen]
    assert KEEP in masks and RECOMPUTE in masks and len(masks) == 30
    for policy in masks + OPS:
        out, grad_in, grads = _grads(
            block, lambda h: policy.forward(BlockSegments(block), h, weights, rope), x, g)
        assert torch.equal(out, ref[0]) and torch.equal(grad_in, ref[1]), policy.name
        assert all(torch.equal(grads[n], ref[2][n]) for n in grads), policy.name


@pytest.mark.parametrize("flavor", FAMILIES)
@pytest.mark.parametrize("spec", ["recompute@offload=1", "keep@offload=0.37",
                                  "segments(qkv+attention_core+mlp_up)@offload=1",
                                  "selective@offload=0.37"])
def test_offload_moves_what_the_block_saves_and_gives_the_same_gradients(flavor, spec):
    """The CPU data path of the offload (copy out, release, copy back): the same gradients,
    every byte out comes back, the offloaded originals are gone after forward, and the bytes
    are what the start-up measurement predicts."""
    policy, args = parse_policy(spec), get_flavor(flavor)
    block = _block(flavor, torch.bfloat16)
    flat, weights = as_streamed(block)
    refs = WeightRefs([flat], lambda unit: flat)
    with torch.device("meta"):
        segments = BlockSegments(QWEN.block_cls(args))
    batch, seq = 2, 40
    rope = rope_tables(args, seq, "cpu")
    g = torch.randn(batch, seq, args.dim, dtype=torch.bfloat16)
    results, traffic = [], Traffic()
    offloader = Offloader(Streams(torch.device("cpu")), traffic)
    cost = measure_costs([policy], args, TORCH_KERNELS, device=torch.device("cpu"),
                         seq_len=seq)[policy]
    offloader.pool.allocate(cost.host.at(batch, seq))
    for fraction in (0.0, policy.offload):
        for w in weights.values():
            w.grad = None
        x = torch.randn(batch, seq, args.dim, dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(1))
        grad_in: list[torch.Tensor] = []
        offloader.begin_micro_batch()
        with offloader.forward_of(1, fraction) as offload, refs.during_forward_of(1, offload):
            out = policy.forward(segments, block_input(x, grad_in), weights, rope)
        if offload is not None:
            gone = [StorageWeakRef(x.untyped_storage())]
            del x
            assert all(ref.expired() for ref in gone), "the block input is still on the GPU"
            assert offloader.blocks_held == 1
        offloader.prefetch(1)
        torch.autograd.backward(get_gradient_edge(out), g)
        offloader.release(1)
        results.append((out, grad_in[0], {n: w.grad for n, w in weights.items()}))
    assert offloader.blocks_held == 0
    (out0, gin0, w0), (out1, gin1, w1) = results
    assert torch.equal(out0, out1) and torch.equal(gin0, gin1)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    assert traffic.offload_d2h == traffic.offload_h2d > 0
    predicted = cost.host.at(batch, seq)
    assert traffic.offload_d2h <= predicted
    if policy.offload == 1:
        assert traffic.offload_d2h == predicted
    offloader.clear()
    assert offloader.pool.nbytes == 0


@pytest.mark.parametrize("flavor", FAMILIES)
def test_measured_costs_hold_at_other_shapes_and_match_the_model(flavor):
    args = get_flavor(flavor)
    policies = [KEEP, RECOMPUTE, SELECTIVE, parse_policy("segments(qkv+attention_core)"),
                parse_policy("ops(matmul+attention)"), parse_policy("recompute@offload=1"),
                parse_policy("keep@offload=0.5")]
    costs = measure_costs(policies, args, TORCH_KERNELS, device=torch.device("cpu"), seq_len=48)
    block = _block(flavor, torch.bfloat16)
    weights = dict(block.named_parameters())
    batch, seq = 3, 48  # neither probe shape
    rope = rope_tables(args, seq, "cpu")
    for policy in policies:  # the probe's fit, at a shape it never ran
        if isinstance(policy, SegmentMask) and not policy.offload:
            x = torch.randn(batch, seq, args.dim, dtype=torch.bfloat16)
            with SavedStorages(exclude=weights.values()) as saved:
                out = policy.forward(BlockSegments(block), block_input(x, []), weights, rope)
            assert costs[policy].gpu.at(batch, seq) == saved.nbytes, policy.name
            out.sum().backward()
    tokens, heads = batch * seq, args.n_heads
    dim, q, kv = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    # Full recompute keeps the block's input only (BF16); offloaded, it is all on the host.
    assert costs[RECOMPUTE].gpu.at(batch, seq) == 2 * dim * tokens
    offloaded = costs[parse_policy("recompute@offload=1")]
    assert offloaded.gpu.at(batch, seq) == 0 and offloaded.host.at(batch, seq) == 2 * dim * tokens
    half = costs[parse_policy("keep@offload=0.5")]
    assert half.host.at(batch, seq) == pytest.approx(costs[KEEP].gpu.at(batch, seq) / 2, abs=1)
    # The op-level policies add what they save to the input: SDPA's output (BF16) and its FP32
    # log-sum-exp per head; then every matmul's output.
    attention = 2 * q + 4 * heads
    assert costs[SELECTIVE].gpu.at(batch, seq) == (2 * dim + attention) * tokens
    matmuls = 2 * (q + 2 * kv + dim + 2 * args.hidden_dim + dim)
    assert (costs[parse_policy("ops(matmul+attention)")].gpu.at(batch, seq)
            == (2 * dim + attention + matmuls) * tokens)
    assert costs[KEEP].gpu.at(batch, seq) > costs[SELECTIVE].gpu.at(batch, seq)
    # Replayed matmul FLOPs (on the CPU the counter sees matmuls): none under keep or when every
    # matmul output is saved; under recompute every one but the down projection, whose output
    # backward never needs (the replay stops before it).
    matmul = 2 * (dim * (q + 2 * kv) + q * dim + 3 * dim * args.hidden_dim)
    assert costs[KEEP].forward_flops_per_token == matmul
    assert costs[KEEP].replay_flops_per_token == 0
    assert costs[parse_policy("ops(matmul+attention)")].replay_flops_per_token == 0
    assert costs[RECOMPUTE].replay_flops_per_token == matmul - 2 * args.hidden_dim * dim


SPECS = ["keep", "recompute", "selective", "ops(matmul)", "ops(matmul+attention)",
         "segments(input_norm+qkv+qk_norm_rope+attention_core+o_proj+post_norm+mlp_up+down_proj)",
         "segments()", "segments(down_proj+qkv)", "recompute@offload=1", "keep@offload=0.37",
         "segments(attention_core)@offload=0.3333333333333333", "ops(attention)@offload=0.5"]


@pytest.mark.parametrize("spec", SPECS)
def test_policy_names_round_trip(spec):
    policy = parse_policy(spec)
    assert parse_policy(policy.name) == policy
    assert parse_policy(f"  {spec.replace('+', ' + ')} ") == policy  # spaces are ignored


def test_canonical_names():
    assert parse_policy("segments(down_proj+qkv)").name == "segments(qkv+down_proj)"
    assert parse_policy("segments()") == RECOMPUTE and parse_policy("ops(attention)") == SELECTIVE
    assert parse_policy(f"segments({'+'.join(QWEN.segments)})").name == "keep"
    assert parse_policy("keep@offload=1").name == "keep@offload=1.0"
    assert parse_policy("recompute@offload=0").name == "recompute"


def test_block_policies_apply_in_order_and_round_trip_through_a_toml_file(tmp_path):
    policies = block_policies(8, default="recompute@offload=0.5", keep_blocks=2,
                              blocks="1-4:segments(qkv+attention_core), 3:keep, 7:selective")
    assert [p.name for p in policies] == [
        "keep", "segments(qkv+attention_core)", "segments(qkv+attention_core)", "keep",
        "segments(qkv+attention_core)", "recompute@offload=0.5", "recompute@offload=0.5",
        "selective"]
    # What a planner writes back, a later run reads: the same policies.
    default = parse_policy("recompute@offload=0.5")
    written = format_blocks(policies, default)
    assert written == ("0:keep, 1-2:segments(qkv+attention_core), 3:keep, "
                       "4:segments(qkv+attention_core), 7:selective")
    path = tmp_path / "policy.toml"
    path.write_text(f'[model]\nflavor = "qwen3-0.6B"\n[slidedp]\nactivation = "{default.name}"\n'
                    f'activation_blocks = "{written}"\n')
    config = parse_config(["--job.config_file", str(path)]).slidedp
    args = get_flavor("qwen3-0.6B")
    policies = block_policies(args.n_layers, default="recompute@offload=0.5", keep_blocks=2,
                              blocks="1-4:segments(qkv+attention_core), 3:keep, 7:selective")
    assert block_policies(args.n_layers, default=config.activation,
                          blocks=config.activation_blocks) == policies
    assert format_blocks([KEEP, KEEP], KEEP) == ""


@pytest.mark.parametrize("spec, words", [
    ("offload", "unknown activation policy"),
    ("segments(qkvv)", "unknown segment 'qkvv'"),
    ("segments(qkv+qkv)", "appears twice"),
    ("ops(softmax)", "ops() takes names from matmul, attention"),
    ("ops()", "ops() takes names"),
    ("keep@offload=1.5", "offload must be in [0, 1]"),
    ("keep@offload=half", "could not convert"),
    ("keep(qkv)", "unknown activation policy"),
])
def test_bad_policies_are_one_line_naming_the_key(spec, words):
    with pytest.raises(ValueError) as info:
        parse_policy(spec, key="slidedp.activation")
    message = str(info.value)
    assert message.startswith("slidedp.activation: ") and words in message and "\n" not in message


@pytest.mark.parametrize("blocks, words", [
    ("0-3", "is not BLOCK:POLICY"),
    ("3-1:keep", "first <= last"),
    ("4:keep", "blocks are 0..3"),
    ("x:keep", "is not BLOCK:POLICY"),
    ("0:kep", "unknown activation policy"),
])
def test_bad_block_entries_are_one_line_naming_the_key(blocks, words):
    with pytest.raises(ValueError) as info:
        block_policies(4, default="recompute", blocks=blocks)
    assert str(info.value).startswith("slidedp.activation_blocks: ") and words in str(info.value)


def test_fused_sdpa_flops_count_grouped_query_attention_as_broadcast():
    """torch before 2.13 asserts on k/v with fewer heads than q (CUDA's fused SDPA ops with
    enable_gqa); the cost probe's formulas count them as if k/v were broadcast."""
    from torch.utils import flop_counter

    from slidedp.activations.cost import GQA_SDPA_FLOPS
    q, kv = torch.Size((2, 8, 128, 64)), torch.Size((2, 2, 128, 64))
    forward = GQA_SDPA_FLOPS[torch.ops.aten._scaled_dot_product_cudnn_attention]
    backward = GQA_SDPA_FLOPS[torch.ops.aten._scaled_dot_product_flash_attention_backward]
    assert forward(q, kv, kv, None, True) == flop_counter.sdpa_flop_count(q, q, q) == 4 * 2 * 8 * 128 * 128 * 64
    assert backward(q, q, kv, kv, None) == flop_counter.sdpa_backward_flop_count(q, q, q, q)
    assert backward(q, q, kv, kv) > forward(q, kv, kv)
