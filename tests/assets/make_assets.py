"""Generate the tiny test assets in tests/assets/tiny/ (deterministic; run from anywhere).

    python tests/assets/make_assets.py [--out DIR]

A templated synthetic corpus (animal sentences, counting runs, addition facts) that a 4-layer
debug model learns within ~100 steps, written once per supported format with the same
documents, plus a Qwen-style byte-level BPE tokenizer (vocab <= 512 with the special tokens).
"""

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from recipes.bpe import train_bpe

TINY_DIR = Path(__file__).resolve().parent / "tiny"
VOCAB_SIZE = 512
NUM_DOCS = 700
NUM_CHATS = 500
PARQUET_ROW_GROUP = 128  # several row groups, so the reader's row-group path is exercised

COLORS = ("red", "blue", "green", "brown", "white", "black")
ANIMALS = ("fox", "dog", "cat", "bird", "horse", "mouse")
VERBS = ("jumps", "runs", "walks", "flies")
ADJECTIVES = ("lazy", "small", "old", "quiet")
THINGS = ("dog", "fence", "river", "hill")
SYSTEM_PROMPT = "you are a helpful assistant ."


def animal_sentence(rng: random.Random) -> str:
    return (f"the {rng.choice(COLORS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} over the "
            f"{rng.choice(ADJECTIVES)} {rng.choice(THINGS)} .")


def count_run(rng: random.Random) -> list[int]:
    start = rng.randint(0, 20)
    return list(range(start, start + rng.randint(4, 8)))


def addition(rng: random.Random) -> tuple[int, int]:
    return rng.randint(0, 20), rng.randint(0, 20)


def random_sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return animal_sentence(rng)
    if kind == 1:
        return "count : " + " ".join(map(str, count_run(rng))) + " ."
    a, b = addition(rng)
    return f"{a} + {b} = {a + b} ."


def make_documents(rng: random.Random) -> list[str]:
    """Plain documents: a few sentences, one per line (no blank lines: .txt splits on them)."""
    return ["\n".join(random_sentence(rng) for _ in range(rng.randint(3, 7)))
            for _ in range(NUM_DOCS)]


def random_exchange(rng: random.Random) -> tuple[str, str]:
    """One (user, assistant) turn whose answer follows from the question."""
    kind = rng.randrange(3)
    if kind == 0:
        return "tell me about an animal .", animal_sentence(rng)
    if kind == 1:
        run = count_run(rng)
        shown, rest = " ".join(map(str, run[:3])), " ".join(map(str, run[3:]))
        return f"continue counting : {shown}", f"{rest} ."
    a, b = addition(rng)
    return f"what is {a} + {b} ?", f"{a} + {b} = {a + b} ."


def make_chats(rng: random.Random) -> list[list[dict[str, str]]]:
    chats = []
    for _ in range(NUM_CHATS):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            user, assistant = random_exchange(rng)
            messages += [{"role": "user", "content": user},
                         {"role": "assistant", "content": assistant}]
        chats.append(messages)
    return chats


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """The assets' byte-level BPE, laid out like Qwen's (recipes/bpe.py)."""
    return train_bpe(texts, vocab_size=VOCAB_SIZE)


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_assets(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    docs, chats = make_documents(rng), make_chats(rng)

    chat_texts = [f"{m['role']}\n{m['content']}" for chat in chats for m in chat]  # roles too
    tokenizer = train_tokenizer(docs + chat_texts)
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= VOCAB_SIZE
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 32768}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    write_jsonl(out_dir / "corpus.jsonl", [{"text": d} for d in docs])
    write_jsonl(out_dir / "chat.jsonl", [{"messages": c} for c in chats])
    (out_dir / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": docs}), out_dir / "corpus.parquet",
                   row_group_size=PARQUET_ROW_GROUP, compression="zstd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_DIR, help="output directory")
    write_assets(parser.parse_args().out)


if __name__ == "__main__":
    main()
