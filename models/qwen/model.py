"""The Qwen3 / Qwen2.5 decoder.

Parameter names match Hugging Face (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...) minus the
`model.` prefix, so checkpoint conversion is a rename of one prefix. Blocks own no buffers and
take the RoPE tables as arguments: a block is a self-contained unit that a runtime can stream,
shard or re-materialize on its own. The memory-bound ops (norms, RoPE, SwiGLU, attention, the
loss) come from the `Kernels` the model is built with (models/kernels.py): plain torch by default.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from models.kernels import TORCH_KERNELS, Kernels
from models.meta import on_meta
from models.qwen.args import QwenArgs
from models.rope import rope_tables
from protocols.model_spec import UnitParams


class RMSNorm(nn.Module):
    """RMSNorm computed in FP32 and cast back, as Hugging Face Qwen does."""

    def __init__(self, dim: int, eps: float, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query causal self-attention with optional QK-norm (Qwen3) or QKV bias (Qwen2.5),
    in the steps that TransformerBlock's segments call."""

    def __init__(self, args: QwenArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.kernels = kernels
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, q, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps, kernels)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps, kernels)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape (batch, seq, heads, head_dim)."""
        bs, seq, _ = x.shape
        q = self.q_proj(x).view(bs, seq, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bs, seq, self.n_kv_heads, self.head_dim)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """QK-norm (Qwen3) and RoPE; q, k, v come back as (batch, heads, seq, head_dim). The
        inputs are left as they are (a runtime may have saved them for a replay)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.kernels.rope_in_place:
            q, k = q.clone(), k.clone()  # the kernel would rotate the projections' outputs
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = self.kernels.rope(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: causal SDPA, (batch, heads, seq, head_dim) out."""
        return self.kernels.sdpa(q, k, v)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        bs, _, seq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(bs, seq, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (TransformerBlock's mlp_up and down_proj segments)."""

    def __init__(self, args: QwenArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.kernels = kernels
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), the input of down_proj."""
        return self.kernels.swiglu(self.gate_proj(x), self.up_proj(x))


BLOCK_SEGMENTS = ("input_norm", "qkv", "qk_norm_rope", "attention_core", "o_proj", "post_norm",
                  "mlp_up", "down_proj")
"""A block's forward, in order: input RMSNorm; q/k/v projections; QK-norm + RoPE; the attention
core; output projection + residual; post-attention RMSNorm; MLP gate/up + SwiGLU; down projection
+ residual. SlideDP's activation policies keep or replay them one by one."""


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block; the unit that SlideDP streams.

    `forward` runs the BLOCK_SEGMENTS one after the other (`run_segments`). Each segment maps the
    tensors the previous one returned to the next ones; the residual stream rides along."""

    segments = BLOCK_SEGMENTS

    def __init__(self, args: QwenArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps, kernels)
        self.self_attn = Attention(args, kernels)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps, kernels)
        self.mlp = MLP(args, kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.run_segments(BLOCK_SEGMENTS, (x,), cos, sin)[0]

    def run_segments(self, names: tuple[str, ...], state: tuple[torch.Tensor, ...],
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The named consecutive segments applied to `state` (what the segment before the first
        returned; `(x,)` before input_norm)."""
        for name in names:
            state = getattr(self, f"_{name}")(*state, rope=(cos, sin))
        return state

    # Each segment: (the previous segment's tensors, rope=(cos, sin)) -> the next ones.

    def _input_norm(self, x, *, rope):
        return x, self.input_layernorm(x)

    def _qkv(self, x, xn, *, rope):
        return x, *self.self_attn.project(xn)

    def _qk_norm_rope(self, x, q, k, v, *, rope):
        return x, *self.self_attn.rotate(q, k, v, *rope)

    def _attention_core(self, x, q, k, v, *, rope):
        return x, self.self_attn.attend(q, k, v)

    def _o_proj(self, x, out, *, rope):
        return (x + self.self_attn.project_out(out),)

    def _post_norm(self, h, *, rope):
        return h, self.post_attention_layernorm(h)

    def _mlp_up(self, h, hn, *, rope):
        return h, self.mlp.activate(hn)

    def _down_proj(self, h, a, *, rope):
        return (h + self.mlp.down_proj(a),)


@torch.no_grad()
def init_parameter(name: str, p: torch.Tensor, *, std: float = 0.02,
                   generator: torch.Generator | None = None) -> None:
    """Initialize one parameter in place by its role (norms 1, biases 0, weights N(0, std))."""
    if name.endswith("norm.weight"):
        p.fill_(1.0)
    elif name.endswith(".bias"):
        p.zero_()
    else:
        p.normal_(0.0, std, generator=generator)


class QwenModel(nn.Module):
    """Embedding -> blocks -> final norm. `lm_head` is None when tied to the embedding.

    `forward` returns the final hidden states; `loss_sum` applies the head so that the full
    (tokens x vocab) logits never exist (chunked, or fused with the cross-entropy).
    """

    def __init__(self, args: QwenArgs, kernels: Kernels = TORCH_KERNELS):
        super().__init__()
        self.args, self.kernels = args, kernels
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, kernels) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, kernels)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def head_weight(self) -> torch.Tensor:
        """The (vocab, dim) output projection, shared with the embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, *, std: float = 0.02) -> None:
        """Random init for training from scratch (normal weights, zero biases, unit norms).
        In place, so it also works on sharded (DTensor) parameters; seed with torch.manual_seed."""
        for name, p in self.named_parameters():
            init_parameter(name, p, std=std)

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor, *,
                 chunk_tokens: int = 4096) -> torch.Tensor:
        """Sum of the token losses of `forward`'s output (labels == IGNORE_INDEX excluded)."""
        return self.kernels.linear_cross_entropy_sum(hidden, self.head_weight(), labels,
                                                     chunk_tokens=chunk_tokens)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.args, tokens.shape[1], tokens.device)
        h = self.embed_tokens(tokens)
        for block in self.layers:
            h = block(h, cos, sin)
        return self.norm(h)


def units(args: QwenArgs) -> list[tuple[str, UnitParams]]:
    """The units SlideDP streams: the embedding, each block, and the head (final norm + untied
    LM head), with their parameters in flat order."""
    with on_meta():
        model = QwenModel(args)
    groups = [("embed", [("embed_tokens.weight", "weight", model.embed_tokens.weight.shape)])]
    for i, block in enumerate(model.layers):
        groups.append(("block", [(f"layers.{i}.{n}", n, p.shape)
                                 for n, p in block.named_parameters()]))
    head = [(n, n, p.shape) for n, p in model.named_parameters()
            if n == "norm.weight" or n.startswith("lm_head.")]
    groups.append(("head", head))
    return groups


def embed(weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The embedding unit's forward on its streamed weights."""
    return F.embedding(tokens, weights["weight"])


class StreamedHead:
    """The head unit's forward and loss on streamed weights: final norm, the LM head (the
    embedding's weight when tied), the chunked or fused cross-entropy."""

    def __init__(self, args: QwenArgs, kernels: Kernels = TORCH_KERNELS):
        self.kernels = kernels
        with on_meta():
            self.norm = RMSNorm(args.dim, args.norm_eps, kernels)

    def __call__(self, head: dict[str, torch.Tensor], embed: dict[str, torch.Tensor],
                 h: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor:
        hn = functional_call(self.norm, {"weight": head["norm.weight"]}, (h,))
        w = head["lm_head.weight"] if "lm_head.weight" in head else embed["weight"]
        return self.kernels.linear_cross_entropy_sum(hn, w, labels, chunk_tokens=chunk_tokens)
