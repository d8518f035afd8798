"""Published Llama 3.1 / 3.2 architectures, plus a tiny debug flavor for CPU tests."""

from models.qwen.args import QwenArgs
from models.rope import RopeScaling


def _scaling(factor: float) -> RopeScaling:
    """Llama 3.1 / 3.2's RoPE scaling (their config.json's rope_scaling)."""
    return RopeScaling(rope_type="llama3", factor=factor, original_max_position_embeddings=8192,
                       low_freq_factor=1.0, high_freq_factor=4.0)


def _llama3(**fields) -> QwenArgs:
    """Qwen's decoder without QK-norm or QKV bias is Llama 3's (same names, norms and RoPE)."""
    return QwenArgs(family="llama3", qk_norm=False, qkv_bias=False, norm_eps=1e-5,
                    rope_theta=500_000.0, **fields)


_PUBLISHED = dict(n_kv_heads=8, vocab_size=128256, max_position_embeddings=131072)

# Parameter counts from the model cards (billions).
PUBLISHED_BILLIONS: dict[str, float] = {"llama3.1-8B": 8.03, "llama3.2-1B": 1.24,
                                        "llama3.2-3B": 3.21}

FLAVORS: dict[str, QwenArgs] = {
    # Untied, and scaled over its 64 positions, so a CPU test sees the head and the llama3 RoPE.
    "llama3-debug": _llama3(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                            hidden_dim=160, vocab_size=512, tie_embeddings=False,
                            max_position_embeddings=256,
                            rope_scaling=RopeScaling(rope_type="llama3", factor=4.0,
                                                     original_max_position_embeddings=64,
                                                     low_freq_factor=1.0, high_freq_factor=4.0)),
    "llama3.1-8B": _llama3(dim=4096, n_layers=32, n_heads=32, head_dim=128, hidden_dim=14336,
                           tie_embeddings=False, rope_scaling=_scaling(8.0), **_PUBLISHED),
    "llama3.2-1B": _llama3(dim=2048, n_layers=16, n_heads=32, head_dim=64, hidden_dim=8192,
                           tie_embeddings=True, rope_scaling=_scaling(32.0), **_PUBLISHED),
    "llama3.2-3B": _llama3(dim=3072, n_layers=28, n_heads=24, head_dim=128, hidden_dim=8192,
                           tie_embeddings=True, rope_scaling=_scaling(32.0), **_PUBLISHED),
}
