"""The Qwen block's anatomy for the planner: what each segment saves for backward, on both
kernel paths, and its FLOPs (slidedp/plan/memory.py and workload.py turn them into bytes and
seconds).

FLOPs per token of a block's segments (forward): qkv 2·dim·(q + 2·kv), attention_core
2·seq·q (causal), o_proj 2·q·dim, mlp_up 4·dim·hidden, down_proj 2·hidden·dim; the norms, QK-norm
+ RoPE and SwiGLU count none (q = n_heads·head_dim, kv = n_kv_heads·head_dim).

Widths: dim; q = n_heads x head_dim; kv = n_kv_heads x head_dim; hidden = the MLP's width; heads
and kv_heads (the per-row FP32 log-sum-exp and inverse RMS); the tables 2 x head_dim per position.
"""

from models.qwen.args import QwenArgs
from models.qwen.model import BLOCK_SEGMENTS
from protocols.model_spec import BlockFlops, SavedTensors

TENSORS: dict[str, tuple[str, bool]] = {
    # name -> (width, FP32: else the compute dtype); "tables" are per position, the rest per token
    "x": ("dim", False), "xn": ("dim", False),                    # block input, input_norm's out
    "q0": ("q", False), "k0": ("kv", False), "v": ("kv", False),  # the q/k/v projections
    "q": ("q", False), "k": ("kv", False),                        # after QK-norm + RoPE
    "o": ("q", False), "lse": ("heads", True),                    # SDPA's output, log-sum-exp
    "o_mm": ("dim", False), "h": ("dim", False), "hn": ("dim", False),  # o_proj, + x, post_norm
    "gate": ("hidden", False), "up": ("hidden", False), "silu": ("hidden", False),
    "a": ("hidden", False), "down_mm": ("dim", False),            # a = SiLU(gate) * up
    # Inside a norm: torch's FP32 copy of the input and the normalized input before the weight;
    # on both paths the FP32 inverse RMS, one per row (per token; per head for QK-norm).
    "x32": ("dim", True), "x_normed": ("dim", False), "x_rstd": ("one", True),
    "h32": ("dim", True), "h_normed": ("dim", False), "h_rstd": ("one", True),
    "q32": ("q", True), "q_normed": ("q", False), "q_rstd": ("heads", True),
    "k32": ("kv", True), "k_normed": ("kv", False), "k_rstd": ("kv_heads", True),
    # RoPE's cos and sin cast to the compute dtype: by each rotation (torch), once (liger)
    "tables_q": ("tables", False), "tables_k": ("tables", False), "tables": ("tables", False),
}
"""The tensors of a block's forward that backward may need; a name is one storage (views, a
reshape without a copy, a tensor saved by two ops are one). SDPA writes its output in the query's
(batch, seq, heads, head_dim) layout, so o_proj's input is a view of it, not a copy."""

SEGMENT_INPUTS: dict[str, tuple[str, ...]] = {
    "input_norm": ("x",), "qkv": ("x", "xn"), "qk_norm_rope": ("x", "q0", "k0", "v"),
    "attention_core": ("x", "q", "k", "v"), "o_proj": ("x", "o"), "post_norm": ("h",),
    "mlp_up": ("h", "hn"), "down_proj": ("h", "a")}
"""What each of BLOCK_SEGMENTS takes (TransformerBlock.run_segments; the residual rides along)."""

SEGMENT_SAVES: dict[str, dict[str, tuple[str, ...]]] = {
    # kernels -> segment -> what its ops save for backward under plain autograd
    "torch": {
        "input_norm": ("x32", "x_normed", "x_rstd"), "qkv": ("xn",),  # a linear: its input
        "qk_norm_rope": ("tables_q", "tables_k"), "attention_core": ("q", "k", "v", "o", "lse"),
        "o_proj": ("o",), "post_norm": ("h32", "h_normed", "h_rstd"),
        "mlp_up": ("hn", "gate", "silu", "up"), "down_proj": ("a",)},
    # liger-kernel's autograd Functions: RMSNorm saves its input and inverse RMS, RoPE (in
    # place) its tables, SwiGLU gate and up (it recomputes SiLU)
    "liger": {
        "input_norm": ("x", "x_rstd"), "qkv": ("xn",),
        "qk_norm_rope": ("tables",), "attention_core": ("q", "k", "v", "o", "lse"),
        "o_proj": ("o",), "post_norm": ("h", "h_rstd"),
        "mlp_up": ("hn", "gate", "up"), "down_proj": ("a",)},
}
QK_NORM_SAVES: dict[str, tuple[str, ...]] = {
    "torch": ("q32", "q_normed", "q_rstd", "k32", "k_normed", "k_rstd"),
    "liger": ("q0", "q_rstd", "k0", "k_rstd")}
"""What the per-head query and key norms of qk_norm_rope add (Qwen3)."""

OP_OUTPUTS: dict[str, tuple[str, ...]] = {
    "attention": ("o", "lse"), "matmul": ("q0", "k0", "v", "o_mm", "gate", "up", "down_mm")}
"""The outputs of SavedOps' op classes (slidedp/activations/policy.py OP_CLASSES)."""


def widths(args: QwenArgs) -> dict[str, int]:
    """Elements of each width key of TENSORS."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"dim": args.dim, "q": q, "kv": kv, "hidden": args.hidden_dim, "heads": args.n_heads,
            "kv_heads": args.n_kv_heads, "one": 1, "tables": 2 * args.head_dim}


def segment_saves(args: QwenArgs, kernels: str) -> dict[str, frozenset[str]]:
    """What each segment's ops save for backward when it is kept."""
    saves = {s: frozenset(names) for s, names in SEGMENT_SAVES[kernels].items()}
    if args.qk_norm:
        saves["qk_norm_rope"] |= frozenset(QK_NORM_SAVES[kernels])
    return saves


def segment_flops(args: QwenArgs, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of each block segment at sequence length `seq`."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    flops = dict.fromkeys(BLOCK_SEGMENTS, 0.0)
    flops.update(qkv=2.0 * args.dim * (q + 2 * kv), attention_core=2.0 * seq * q,
                 o_proj=2.0 * q * args.dim, mlp_up=4.0 * args.dim * args.hidden_dim,
                 down_proj=2.0 * args.hidden_dim * args.dim)
    return flops


SAVED = SavedTensors(tensors=TENSORS, widths=widths, inputs=SEGMENT_INPUTS, saves=segment_saves,
                     op_outputs=OP_OUTPUTS)
FLOPS = BlockFlops(per_token=segment_flops, attention="attention_core",
                   terminal_linears=frozenset(("qkv", "o_proj", "down_proj")))
