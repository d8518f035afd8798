"""Round trips between the Qwen model and Hugging Face model directories (config.json +
safetensors)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.hf_checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    args_from_hf_config,
    hf_tensor_shapes,
    iter_hf_tensors,
    load_config_json,
    load_hf_into,
    load_hf_into_model,
    match_flavor,
    param_shapes,
    read_hf_config,
    save_hf_checkpoint,
    to_hf_config,
)
from protocols.model_spec import ModelArgs, get_model_spec

QWEN = get_model_spec("qwen")
DEBUG_FLAVORS = ["qwen3-debug", "qwen2.5-debug"]

# As published on the Hugging Face hub (Qwen/Qwen3-8B, Qwen/Qwen2.5-7B).
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064,
}


def make_model(flavor: str, *, seed: int = 0, args: ModelArgs | None = None) -> nn.Module:
    """A random `flavor` (or `args`) model; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = QWEN.model_cls(args or QWEN.flavors[flavor])
    model.init_weights()
    return model


def hf_keys(model_dir: Path) -> dict[str, str]:
    """HF tensor key -> file name, read from the files themselves."""
    keys = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            keys.update(dict.fromkeys(f.keys(), file.name))
    return keys


def write_raw_checkpoint(model_dir: Path, tensors: dict[str, torch.Tensor], flavor: str) -> None:
    """A hand-made HF directory (not through save_hf_checkpoint), for malformed-file cases."""
    model_dir.mkdir()
    (model_dir / CONFIG_FILE).write_text(json.dumps(to_hf_config(QWEN.flavors[flavor])))
    save_file(tensors, model_dir / SINGLE_FILE, metadata={"format": "pt"})


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {(n if n == "lm_head.weight" else "model." + n): p.detach().clone()
            for n, p in model.named_parameters()}


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name


@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 64 * 1024])
def test_roundtrip_fp32_bit_exact(tmp_path: Path, flavor: str, max_shard_bytes: int) -> None:
    src, out = make_model(flavor, seed=0), tmp_path / "out"
    save_hf_checkpoint(src.named_parameters(), src.args, out, dtype=torch.float32,
                       max_shard_bytes=max_shard_bytes)
    assert read_hf_config(out) == src.args
    assert match_flavor(read_hf_config(out)) == flavor
    dst = make_model(flavor, seed=1)
    load_hf_into_model(dst, out)
    assert_params_equal(src, dst)
    assert not (tmp_path / "out.tmp").exists()


@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
def test_bf16_save_equals_cast(tmp_path: Path, flavor: str) -> None:
    src = make_model(flavor)
    save_hf_checkpoint(src.named_parameters(), src.args, tmp_path)
    cfg = load_config_json(tmp_path)
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    params = dict(src.named_parameters())
    loaded = dict(iter_hf_tensors(tmp_path))
    assert loaded.keys() == params.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, params[name].detach().to(torch.bfloat16)), name
    dst = make_model(flavor, seed=1)
    load_hf_into_model(dst, tmp_path)  # bf16 file into an fp32 model: cast on copy
    for name, p in dst.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, params[name].detach().to(torch.bfloat16).float()), name


@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
def test_sharded_layout(tmp_path: Path, flavor: str) -> None:
    src = make_model(flavor)
    save_hf_checkpoint(src.named_parameters(), src.args, tmp_path, dtype=torch.float32,
                       max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and not (tmp_path / SINGLE_FILE).exists()
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == hf_keys(tmp_path)
    assert set(index["weight_map"]) == set(hf_state(src))
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in src.parameters())
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_gets_the_mode_of_a_new_file(tmp_path: Path, umask: int) -> None:
    """The weights as readable as the config beside them (safetensors alone would make them
    0o600): every file 0o666 less the umask, in one file or in shards."""
    src = make_model("qwen3-debug")
    old = os.umask(umask)
    try:
        for out, shard in ((tmp_path / "one", 5 * 2**30), (tmp_path / "shards", 64 * 1024)):
            save_hf_checkpoint(src.named_parameters(), src.args, out, max_shard_bytes=shard)
            modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
            assert len(modes) > 1 and set(modes.values()) == {0o666 & ~umask}, modes
    finally:
        os.umask(old)


def test_single_file_layout(tmp_path: Path) -> None:
    src = make_model("qwen2.5-debug")
    save_hf_checkpoint(src.named_parameters(), src.args, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_FILE, SINGLE_FILE]
    keys = hf_keys(tmp_path)
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    assert all(k == "lm_head.weight" or k.startswith("model.") for k in keys)


def test_config_json_fields(tmp_path: Path) -> None:
    for flavor, arch, model_type in [("qwen3-debug", "Qwen3ForCausalLM", "qwen3"),
                                     ("qwen2.5-debug", "Qwen2ForCausalLM", "qwen2")]:
        cfg = to_hf_config(QWEN.flavors[flavor], dtype=torch.float32)
        assert cfg["architectures"] == [arch] and cfg["model_type"] == model_type
        assert cfg["hidden_act"] == "silu" and cfg["use_sliding_window"] is False
        assert cfg["torch_dtype"] == "float32"
        assert ("attention_bias" in cfg) == (model_type == "qwen3")
        assert args_from_hf_config(cfg) == QWEN.flavors[flavor]


def test_source_config_and_tokenizer_preserved(tmp_path: Path) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        (src_dir / name).write_text(f'{{"file": "{name}"}}')
    source = {**to_hf_config(QWEN.flavors["qwen3-debug"]), "bos_token_id": 7, "eos_token_id": 8,
              "custom_key": "kept", "tie_word_embeddings": False, "torch_dtype": "float16"}
    model = make_model("qwen3-debug")
    save_hf_checkpoint(model.named_parameters(), model.args, tmp_path / "out",
                       copy_tokenizer_from=src_dir, source_config=source)
    cfg = load_config_json(tmp_path / "out")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["custom_key"]) == (7, 8, "kept")
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16"
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (tmp_path / "out" / name).read_text() == (src_dir / name).read_text()
    assert not (tmp_path / "out" / "vocab.json").exists()


def test_transformers_v5_rope_parameters(tmp_path: Path) -> None:
    cfg = {k: v for k, v in QWEN3_8B_CONFIG.items() if k != "rope_theta"}
    cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    assert match_flavor(args_from_hf_config(cfg)) == "qwen3-8B"
    args = QWEN.flavors["qwen3-8B"]
    saved = to_hf_config(args, source_config=cfg)
    assert saved["rope_parameters"]["rope_theta"] == args.rope_theta


def test_rope_scaling_round_trips_and_replaces_the_source_config() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    source = {**QWEN3_8B_CONFIG, "rope_scaling": yarn}
    args = args_from_hf_config(source)
    assert args.rope_scaling is not None and args.max_positions() == 131072
    saved = to_hf_config(args, source_config=source)
    assert saved["rope_scaling"] == yarn and args_from_hf_config(saved) == args
    # A run that changed the scaling (or turned it off) saves its own, in both spellings.
    factor8 = dataclasses.replace(args.rope_scaling, factor=8.0)
    v5 = {**source, "rope_scaling": None, "rope_parameters": {"rope_theta": 1e6, **yarn}}
    saved = to_hf_config(dataclasses.replace(args, rope_scaling=factor8), source_config=v5)
    assert saved["rope_scaling"] == {**yarn, "factor": 8.0}
    assert saved["rope_parameters"] == {"rope_theta": 1e6, **yarn, "factor": 8.0}
    saved = to_hf_config(dataclasses.replace(args, rope_scaling=None), source_config=v5)
    assert saved["rope_scaling"] is None
    assert saved["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert args_from_hf_config(saved).rope_scaling is None


def test_save_replaces_existing_and_crash_leaves_nothing(tmp_path: Path) -> None:
    model, out = make_model("qwen3-debug"), tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_hf_checkpoint(model.named_parameters(), model.args, out)
    assert not (out / "stale.txt").exists() and (out / SINGLE_FILE).exists()

    def crashing():
        for i, item in enumerate(model.named_parameters()):
            if i == 10:
                raise RuntimeError("boom")
            yield item

    with pytest.raises(RuntimeError, match="boom"):
        save_hf_checkpoint(crashing(), model.args, tmp_path / "crashed", max_shard_bytes=1024)
    assert not (tmp_path / "crashed").exists() and not (tmp_path / "crashed.tmp").exists()


def test_save_rejects_bad_tensors(tmp_path: Path) -> None:
    model = make_model("qwen2.5-debug")
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="missing tensors.*norm.weight"):
        save_hf_checkpoint(params[:-2], model.args, tmp_path / "a")
    with pytest.raises(ValueError, match="'bogus.weight': not a parameter"):
        save_hf_checkpoint(params + [("bogus.weight", torch.zeros(1))], model.args, tmp_path / "b")
    with pytest.raises(ValueError, match="'norm.weight': shape"):
        save_hf_checkpoint(params[:-2] + [("norm.weight", torch.zeros(3))], model.args,
                           tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


def test_save_accepts_views_of_a_flat_buffer(tmp_path: Path) -> None:
    # The streaming runtime keeps parameters as views of one host buffer.
    model = make_model("qwen3-debug")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    views, offset = [], 0
    for name, p in model.named_parameters():
        views.append((name, flat[offset:offset + p.numel()].view(p.shape)))
        offset += p.numel()
    save_hf_checkpoint(views, model.args, tmp_path, dtype=torch.float32)
    dst = make_model("qwen3-debug", seed=1)
    load_hf_into_model(dst, tmp_path)
    assert_params_equal(model, dst)


def test_tied_checkpoint_with_lm_head_loads(tmp_path: Path) -> None:
    model = make_model("qwen3-debug")
    assert model.args.tie_embeddings
    state = hf_state(model)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    write_raw_checkpoint(tmp_path / "ckpt", state, "qwen3-debug")
    assert "lm_head.weight" not in hf_tensor_shapes(tmp_path / "ckpt")
    dst = make_model("qwen3-debug", seed=1)
    load_hf_into_model(dst, tmp_path / "ckpt")
    assert_params_equal(model, dst)
    # Re-saving it drops the head again, and a tied model passing its head is fine too.
    save_hf_checkpoint([*model.named_parameters(), ("lm_head.weight", model.head_weight())],
                       model.args, tmp_path / "out")
    assert "lm_head.weight" not in hf_keys(tmp_path / "out")


def test_iter_names_filter_and_generic_load(tmp_path: Path) -> None:
    model = make_model("qwen2.5-debug")
    save_hf_checkpoint(model.named_parameters(), model.args, tmp_path, dtype=torch.float32,
                       max_shard_bytes=64 * 1024)
    wanted = {"layers.2.mlp.up_proj.weight", "lm_head.weight", "not.a.tensor"}
    assert {n for n, _ in iter_hf_tensors(tmp_path, names=wanted)} == wanted - {"not.a.tensor"}
    received: dict[str, torch.Tensor] = {}
    load_hf_into(received.__setitem__, tmp_path, param_shapes(model.args))
    assert received.keys() == dict(model.named_parameters()).keys()
    assert torch.equal(received["norm.weight"], model.norm.weight)


def test_match_flavor_published_configs() -> None:
    assert match_flavor(args_from_hf_config(QWEN3_8B_CONFIG)) == "qwen3-8B"
    assert match_flavor(args_from_hf_config(QWEN25_7B_CONFIG)) == "qwen2.5-7B"
    assert args_from_hf_config(QWEN25_7B_CONFIG).head_dim == 128  # derived: 3584 / 28
    other = {**QWEN3_8B_CONFIG, "num_hidden_layers": 3}
    assert match_flavor(args_from_hf_config(other)) is None
    for name, flavor in QWEN.flavors.items():
        assert match_flavor(args_from_hf_config(to_hf_config(flavor))) == name


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        read_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        read_hf_config(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({**QWEN3_8B_CONFIG, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="config.json: unsupported model_type 'mistral'"):
        read_hf_config(tmp_path)
    cfg = {k: v for k, v in QWEN3_8B_CONFIG.items() if k != "intermediate_size"}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: missing field 'intermediate_size'"):
        read_hf_config(tmp_path)
    with pytest.raises(ValueError, match="missing field 'head_dim'"):
        args_from_hf_config({k: v for k, v in QWEN3_8B_CONFIG.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="config.json: rope scaling 'mrope' is not supported"):
        args_from_hf_config({**QWEN3_8B_CONFIG, "rope_scaling": {"rope_type": "mrope"}})
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        read_hf_config(tmp_path)


def test_load_errors(tmp_path: Path) -> None:
    model = make_model("qwen2.5-debug")
    state = hf_state(model)

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / CONFIG_FILE).write_text(json.dumps(to_hf_config(model.args)))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf_into_model(model, config_only)

    write_raw_checkpoint(tmp_path / "missing", {k: v for k, v in state.items()
                                                if k != "model.norm.weight"}, "qwen2.5-debug")
    with pytest.raises(ValueError, match=r"missing \[norm.weight\]"):
        load_hf_into_model(model, tmp_path / "missing")

    write_raw_checkpoint(tmp_path / "shape", {**state, "model.norm.weight": torch.zeros(3)},
                         "qwen2.5-debug")
    with pytest.raises(ValueError, match=r"wrong shape \[norm.weight \(3,\) vs expected \(64,\)\]"):
        load_hf_into_model(model, tmp_path / "shape")

    write_raw_checkpoint(tmp_path / "extra", {**state, "model.extra": torch.zeros(1)},
                         "qwen2.5-debug")
    with pytest.raises(ValueError, match=r"unexpected \[extra\]"):
        load_hf_into_model(model, tmp_path / "extra")
    norm_before = model.norm.weight.detach().clone()
    load_hf_into_model(model, tmp_path / "missing", strict=False)  # tolerated, rest loaded
    assert torch.equal(model.norm.weight, norm_before)

    # A qwen3 checkpoint into a qwen2.5 model: every name problem reported in one line.
    other = make_model("qwen3-debug")
    save_hf_checkpoint(other.named_parameters(), other.args, tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"missing \[.*\(\+\d+ more\)\]; unexpected \[.*q_norm"):
        load_hf_into_model(model, tmp_path / "qwen3")


# config.json rope_scaling for a tiny model of 32 positions, compared on 48-token sequences (so
# dynamic NTK and longrope take their long-sequence frequencies).
TINY_ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "longrope", "original_max_position_embeddings": 32, "factor": 2.0,
     "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [1.0 + i for i in range(8)]},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
]


@pytest.mark.parametrize("rope_scaling", TINY_ROPE_SCALINGS,
                         ids=lambda r: r["rope_type"] if r else "default")
@pytest.mark.parametrize("flavor", DEBUG_FLAVORS)
def test_transformers_loads_saved_dir(tmp_path: Path, flavor: str, rope_scaling) -> None:
    """Our logits equal transformers' Qwen3ForCausalLM / Qwen2ForCausalLM on the saved
    directory, RoPE scaling included (read by transformers from the config.json we write)."""
    transformers = pytest.importorskip("transformers")
    base = dataclasses.replace(QWEN.flavors[flavor], max_position_embeddings=32)
    args = args_from_hf_config({**to_hf_config(base), "rope_scaling": rope_scaling})
    model, plain = make_model(flavor, args=args), make_model(flavor, args=base)
    save_hf_checkpoint(model.named_parameters(), args, tmp_path, dtype=torch.float32)
    assert read_hf_config(tmp_path) == args
    cls = transformers.Qwen3ForCausalLM if args.family == "qwen3" else \
        transformers.Qwen2ForCausalLM
    hf_model = cls.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 48))
    with torch.no_grad():
        ours = model(tokens) @ model.head_weight().T
        theirs = hf_model(tokens).logits
        unscaled = plain(tokens) @ plain.head_weight().T
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (rope_scaling is None) == torch.allclose(unscaled, ours, atol=1e-3, rtol=0)
