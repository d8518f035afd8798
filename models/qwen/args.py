"""Architecture hyper-parameters shared by the Qwen3 and Qwen2.5 families."""

from dataclasses import dataclass

from models.rope import RopeScaling


@dataclass(frozen=True)
class QwenArgs:
    """One Qwen flavor: everything needed to build the network and count its size."""

    family: str
    """"qwen3" or "qwen2.5", or the family of another spec built on this decoder; finds the
    flavor's ModelSpec, whose adapter writes the Hugging Face `model_type` on save."""
    dim: int
    """Hidden size (HF `hidden_size`)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Query heads."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Per-head size; Qwen3 decouples it from dim / n_heads."""
    hidden_dim: int
    """SwiGLU intermediate size (HF `intermediate_size`)."""
    vocab_size: int
    """Embedding rows (HF `vocab_size`, padded as published)."""
    qk_norm: bool
    """RMSNorm on queries and keys per head (Qwen3 yes, Qwen2.5 no)."""
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2.5 yes, Qwen3 no)."""
    tie_embeddings: bool
    """LM head shares the embedding matrix."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 32768
    """Longest position the published model was trained for (written back to config.json)."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling for contexts beyond max_position_embeddings (HF `rope_scaling`); None: none."""

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            values = getattr(self.rope_scaling, name, None)
            if values is not None and len(values) != self.head_dim // 2:
                raise ValueError(f"longrope {name} needs head_dim / 2 = {self.head_dim // 2} "
                                 f"values, got {len(values)}")

    def max_positions(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, or with a RoPE scaling
        factor x the positions it scales (the original ones, else max_position_embeddings) where
        that is more."""
        scaling = self.rope_scaling
        if scaling is None:
            return self.max_position_embeddings
        scaled = scaling.original_max_position_embeddings or self.max_position_embeddings
        return max(self.max_position_embeddings, int(scaling.factor * scaled))

    def describe_positions(self) -> str:
        """E.g. "262,144 positions (RoPE yarn x8 over 32,768)", "40,960 positions
        (max_position_embeddings)"."""
        how = f"RoPE {self.rope_scaling.describe()}" if self.rope_scaling else \
            "max_position_embeddings"
        return f"{self.max_positions():,} positions ({how})"

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q + 2 * self.dim * kv + q * self.dim
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + 3 * self.dim * self.hidden_dim + 2 * self.dim

    def num_params(self) -> int:
        """Total parameter count, embeddings counted once when tied."""
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else emb
        return emb + head + self.n_layers * self.block_params() + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as docs/DESIGN.md §7.1 counts them: 6·N (all parameters)
        plus causal attention 6·L·seq·(n_heads·head_dim); recomputation is not counted."""
        attn = 6.0 * self.n_layers * seq_len * self.n_heads * self.head_dim
        return 6.0 * self.num_params() + attn
