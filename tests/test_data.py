"""recipes/data.py, documents.py and tokenizer.py: sources, chat masks, packing, sharding,
determinism, resume, errors, assets."""

import importlib.util
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from models.loss import IGNORE_INDEX
from recipes.data import PackedDataLoader, epoch_permutation, tokenize_corpus
from recipes.documents import DataError, read_documents, record_document
from recipes.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parent / "assets"
TINY = ASSETS / "tiny"
SEQ_LEN = 32


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


def make_loader(tok, paths: str | Path, **kwargs) -> PackedDataLoader:
    tokenizer, eos_id = tok
    kwargs = {"seq_len": SEQ_LEN, "local_batch_size": 2} | kwargs
    return PackedDataLoader(str(paths), tokenizer, eos_id=eos_id, **kwargs)


def take(loader: PackedDataLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(iter(loader), n))


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def decode(tokenizer, ids: torch.Tensor) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def first_epoch_stream(loader: PackedDataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    """Epoch 0's packed tokens and target flags, rebuilt from the corpus and the permutation."""
    corpus = loader.corpus
    order = epoch_permutation(seed=loader.seed, epoch=0, num_docs=corpus.num_docs).tolist()
    spans = [(int(corpus.offsets[d]), int(corpus.offsets[d + 1])) for d in order]
    return (torch.cat([corpus.tokens[a:b] for a, b in spans]).long(),
            torch.cat([corpus.targets[a:b] for a, b in spans]))


def test_tokenizer_assets(tok):
    tokenizer, eos_id = tok
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= 512
    assert eos_id == tokenizer.token_to_id("<|endoftext|>")
    for special in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.token_to_id(special) is not None


def test_eos_fallbacks(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((TINY / "tokenizer.json").read_bytes())
    tokenizer, _ = tok
    assert load_tokenizer(tmp_path)[1] == tokenizer.token_to_id("<|endoftext|>")  # default
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert load_tokenizer(tmp_path)[1] == 7
    eos_as_added_token = {"eos_token": {"content": "<|im_end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(eos_as_added_token))
    assert load_tokenizer(tmp_path)[1] == tokenizer.token_to_id("<|im_end|>")


def test_packing_shapes_and_shift(tok):
    loader = make_loader(tok, TINY / "corpus.jsonl", local_batch_size=3)
    batches = take(loader, 4)
    stream, targets = first_epoch_stream(loader)
    for step, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (3, SEQ_LEN) and x.dtype == y.dtype == torch.int64
        for row in range(3):
            start = (step * 3 + row) * (SEQ_LEN + 1)
            sample = stream[start:start + SEQ_LEN + 1]
            assert torch.equal(x[row], sample[:-1])
            expected = sample[1:].masked_fill(~targets[start + 1:start + SEQ_LEN + 1], IGNORE_INDEX)
            assert torch.equal(y[row], expected)
    assert int(max(x.max() for x, _ in batches)) < 512
    # Plain text: every label is a target, EOS included.
    assert all((y != IGNORE_INDEX).all() for _, y in batches)


def test_chat_targets_are_assistant_tokens(tok):
    tokenizer, eos_id = tok
    messages = [{"role": "system", "content": "you are a helpful assistant ."},
                {"role": "user", "content": "what is 2 + 3 ?"},
                {"role": "assistant", "content": "2 + 3 = 5 ."},
                {"role": "user", "content": "continue counting : 1 2 3"},
                {"role": "assistant", "content": "4 5 6 ."}]
    doc = record_document({"messages": messages}, where="test")
    corpus = tokenize_corpus([doc], tokenizer, eos_id=eos_id)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert decode(tokenizer, corpus.tokens) == rendered + "<|endoftext|>"
    targets = decode(tokenizer, corpus.tokens[corpus.targets])
    assert targets == "2 + 3 = 5 .<|im_end|>4 5 6 .<|im_end|>"


def test_chat_labels_in_packed_batches(tok):
    tokenizer, _ = tok
    seq_len = 128  # a few whole conversations
    loader = make_loader(tok, TINY / "chat.jsonl", seq_len=seq_len)
    stream, targets = first_epoch_stream(loader)
    _, y = take(loader, 1)[0]
    expected = stream[1:seq_len + 1].masked_fill(~targets[1:seq_len + 1], IGNORE_INDEX)
    assert torch.equal(y[0], expected)
    kept = decode(tokenizer, y[0][y[0] != IGNORE_INDEX])
    assert "<|im_start|>" not in kept and "user" not in kept and "<|endoftext|>" not in kept
    assert "<|im_end|>" in kept


def test_formats_give_the_same_stream(tok, tmp_path):
    chat_rows = [json.loads(line) for line in (TINY / "chat.jsonl").read_text().splitlines()]
    pq.write_table(pa.table({"messages": [r["messages"] for r in chat_rows]}),
                   tmp_path / "chat.parquet", row_group_size=50)
    reference = take(make_loader(tok, TINY / "corpus.jsonl"), 30)
    for name in ("corpus.txt", "corpus.parquet"):
        assert_same_batches(take(make_loader(tok, TINY / name), 30), reference)
    assert_same_batches(take(make_loader(tok, tmp_path / "chat.parquet"), 30),
                        take(make_loader(tok, TINY / "chat.jsonl"), 30))


def test_paths_directory_and_list(tmp_path):
    for name, text in (("b.txt", "two\n\n\nthree\nlines"), ("a.jsonl", '{"text": "one"}\n\n'),
                       ("skip.md", "ignored")):
        (tmp_path / name).write_text(text)
    def texts(paths: str) -> list[str]:
        return [doc.segments[0][0] for doc in read_documents(paths)]

    assert texts(str(tmp_path)) == ["one", "two", "three\nlines"]
    assert texts(f"{tmp_path / 'b.txt'}, {tmp_path / 'a.jsonl'}") == ["two", "three\nlines", "one"]


@pytest.mark.parametrize("world", [2, 3])
def test_rank_shards_are_disjoint_and_complete(tok, world):
    batch, steps = 2, 5
    world_one = make_loader(tok, TINY / "corpus.jsonl", local_batch_size=1)
    single = [x[0] for x, _ in take(world_one, batch * world * steps)]
    for rank in range(world):
        loader = make_loader(tok, TINY / "corpus.jsonl", local_batch_size=batch,
                             dp_rank=rank, dp_world=world)
        for step, (x, _) in enumerate(take(loader, steps)):
            for i in range(batch):
                assert torch.equal(x[i], single[step * batch * world + i * world + rank])


def test_state_is_the_same_on_every_rank(tok):
    states = []
    for rank in range(3):
        loader = make_loader(tok, TINY / "corpus.jsonl", dp_rank=rank, dp_world=3)
        take(loader, 4)
        states.append(loader.state_dict())
    assert states[0] == states[1] == states[2]


def test_seed_determinism(tok):
    a = take(make_loader(tok, TINY / "corpus.jsonl", seed=1), 5)
    assert_same_batches(take(make_loader(tok, TINY / "corpus.jsonl", seed=1), 5), a)
    b = take(make_loader(tok, TINY / "corpus.jsonl", seed=2), 5)
    assert not all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))
    epochs = [epoch_permutation(seed=1, epoch=e, num_docs=100) for e in (0, 1)]
    assert not torch.equal(*epochs)  # reshuffled every epoch


def test_resume_equals_uninterrupted_across_epochs(tok, tmp_path):
    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * (i + 1)}) + "\n"
                                                  for i in range(5)))
    uninterrupted = make_loader(tok, tmp_path / "small.jsonl", seq_len=8, dp_rank=1, dp_world=2)
    expected = take(uninterrupted, 12)
    assert uninterrupted.epoch >= 3  # the resume points below straddle epoch boundaries
    for stop in (3, 7):
        first = make_loader(tok, tmp_path / "small.jsonl", seq_len=8, dp_rank=1, dp_world=2)
        head = take(first, stop)
        resumed = make_loader(tok, tmp_path / "small.jsonl", seq_len=8, dp_rank=1, dp_world=2)
        resumed.load_state_dict(first.state_dict())
        assert_same_batches(head + take(resumed, 12 - stop), expected)


def test_resume_on_another_world_size_continues_the_global_stream(tok):
    world_one = make_loader(tok, TINY / "corpus.jsonl", local_batch_size=1)
    single = [x[0] for x, _ in take(world_one, 14)]
    two_ranks = make_loader(tok, TINY / "corpus.jsonl", dp_rank=1, dp_world=2)
    take(two_ranks, 3)  # 3 steps x 2 samples x 2 ranks
    one_rank = make_loader(tok, TINY / "corpus.jsonl", local_batch_size=1)
    one_rank.load_state_dict(two_ranks.state_dict())
    assert all(torch.equal(x[0], single[12 + i]) for i, (x, _) in enumerate(take(one_rank, 2)))


def test_resume_rejects_other_settings(tok):
    state = make_loader(tok, TINY / "corpus.jsonl").state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        make_loader(tok, TINY / "corpus.jsonl", seq_len=SEQ_LEN + 1).load_state_dict(state)


def test_error_messages(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found in"):
        load_tokenizer(tmp_path)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"data path not found: {missing}"):
        make_loader(tok, missing)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=f"{bad}:3: malformed JSON"):
        make_loader(tok, bad)
    bad.write_text('{"text": "fine"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=f"{bad}:2: expected an object with a 'text'"):
        make_loader(tok, bad)
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=f"{bad}:1: each message needs"):
        make_loader(tok, bad)


def same_asset(a: Path, b: Path) -> bool:
    if a.suffix == ".parquet":  # the writer stamps its version in the file: compare the table
        return pq.read_table(a).equals(pq.read_table(b))
    return a.read_bytes() == b.read_bytes()


def test_committed_assets_match_generator(tmp_path):
    spec = importlib.util.spec_from_file_location("make_assets", ASSETS / "make_assets.py")
    make_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_assets)
    make_assets.write_assets(tmp_path)
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated == sorted(p.name for p in TINY.iterdir())
    for name in generated:
        assert same_asset(tmp_path / name, TINY / name), f"{name} is stale: run make_assets.py"
    assert sum(p.stat().st_size for p in TINY.iterdir()) < 1 << 20


def test_a_corpus_smaller_than_a_sample_is_refused_and_one_smaller_than_a_step_said_once(
        tok, tmp_path, caplog):
    """Fewer tokens than one sample: refused, naming both counts. Fewer than one step's: one
    warning, and no line for each of the epochs every step then spans."""
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "doc one two"}) + "\n")
    with pytest.raises(DataError, match=r"tiny.jsonl: \d+ tokens, fewer than one sample of "
                                        r"seq_len \+ 1 = 65: use more data"):
        make_loader(tok, tmp_path / "tiny.jsonl", seq_len=64)
    with caplog.at_level("INFO", logger="recipes.data"):
        loader = make_loader(tok, tmp_path / "tiny.jsonl", seq_len=2, local_batch_size=8)
        take(loader, 3)
    assert loader.epoch > 3
    said = [r.getMessage() for r in caplog.records]
    assert sum("fewer than one step's" in m for m in said) == 1, said
    assert not any("begins" in m for m in said), said


def test_blank_lines_in_json_lines_are_skipped_and_said_once(tok, tmp_path, caplog):
    """A JSONL file holds no blank line unless its writing went wrong: the records around it
    are read, and one warning names the file, the count and the first line, over every epoch."""
    row = json.dumps({"text": "one two three four five six seven eight nine ten"})
    (tmp_path / "gaps.jsonl").write_text(f"{row}\n\n{row}\n  \n{row}\n")
    with caplog.at_level("INFO", logger="recipes.data"):
        loader = make_loader(tok, tmp_path / "gaps.jsonl", seq_len=8, local_batch_size=2)
        take(loader, 20)
    assert loader.epoch > 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [m for m in said if "blank" in m] == [
        f"data: {tmp_path / 'gaps.jsonl'}: skipped 2 blank line(s), the first is line 2"], said
