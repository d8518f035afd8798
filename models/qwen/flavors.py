"""Published Qwen3 / Qwen2.5 architectures, plus tiny debug flavors for CPU tests."""

from models.qwen.args import QwenArgs

_QWEN3 = dict(family="qwen3", head_dim=128, vocab_size=151936, qk_norm=True, qkv_bias=False,
              max_position_embeddings=40960)
_QWEN25 = dict(family="qwen2.5", qk_norm=False, qkv_bias=True, max_position_embeddings=32768)

# Published sizes (billions) from the model cards, used by tests and the start-up log.
PUBLISHED_BILLIONS: dict[str, float] = {
    "qwen3-0.6B": 0.6, "qwen3-1.7B": 1.7, "qwen3-4B": 4.0, "qwen3-8B": 8.2, "qwen3-14B": 14.8,
    "qwen3-32B": 32.8, "qwen2.5-0.5B": 0.49, "qwen2.5-1.5B": 1.54, "qwen2.5-3B": 3.09,
    "qwen2.5-7B": 7.61, "qwen2.5-14B": 14.7, "qwen2.5-32B": 32.5, "qwen2.5-72B": 72.7,
}

FLAVORS: dict[str, QwenArgs] = {
    "qwen3-debug": QwenArgs(family="qwen3", dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                            head_dim=16, hidden_dim=160, vocab_size=512, qk_norm=True,
                            qkv_bias=False, tie_embeddings=True, rope_theta=10000.0),
    "qwen2.5-debug": QwenArgs(family="qwen2.5", dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                              head_dim=16, hidden_dim=160, vocab_size=512, qk_norm=False,
                              qkv_bias=True, tie_embeddings=False, rope_theta=10000.0),
    "qwen3-0.6B": QwenArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072,
                           tie_embeddings=True, **_QWEN3),
    "qwen3-1.7B": QwenArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144,
                           tie_embeddings=True, **_QWEN3),
    "qwen3-4B": QwenArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728,
                         tie_embeddings=True, **_QWEN3),
    "qwen3-8B": QwenArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288,
                         tie_embeddings=False, **_QWEN3),
    "qwen3-14B": QwenArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408,
                          tie_embeddings=False, **_QWEN3),
    "qwen3-32B": QwenArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600,
                          tie_embeddings=False, **_QWEN3),
    "qwen2.5-0.5B": QwenArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                             hidden_dim=4864, vocab_size=151936, tie_embeddings=True, **_QWEN25),
    "qwen2.5-1.5B": QwenArgs(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                             hidden_dim=8960, vocab_size=151936, tie_embeddings=True, **_QWEN25),
    "qwen2.5-3B": QwenArgs(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, head_dim=128,
                           hidden_dim=11008, vocab_size=151936, tie_embeddings=True, **_QWEN25),
    "qwen2.5-7B": QwenArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                           hidden_dim=18944, vocab_size=152064, tie_embeddings=False, **_QWEN25),
    "qwen2.5-14B": QwenArgs(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, head_dim=128,
                            hidden_dim=13824, vocab_size=152064, tie_embeddings=False, **_QWEN25),
    "qwen2.5-32B": QwenArgs(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128,
                            hidden_dim=27648, vocab_size=152064, tie_embeddings=False, **_QWEN25),
    "qwen2.5-72B": QwenArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                            hidden_dim=29568, vocab_size=152064, tie_embeddings=False, **_QWEN25),
}

