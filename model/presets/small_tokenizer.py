"""Generate model/presets/small_tokenizer.json: the `small` preset's byte-level BPE.

    python -m flashpd.model.presets.small_tokenizer [--out PATH] [--max-chars N]

Trained with `tokenizers` on the chat text of the ShareGPT training split (the held-out threads
are never seen; flashpd.model.train_data), the first `--max-chars` characters of it in dataset
order. Ids 0..4 are the special tokens of the chat template (2 = pad, the Engram pad id), as in
the tiny tokenizer; the 256 byte-level symbols follow, so any text encodes.
"""

from __future__ import annotations

import argparse
import os

from flashpd.model import train_data
from flashpd.model.presets.small import VOCAB_SIZE

DEFAULT_MAX_CHARS = 24_000_000


def training_texts(max_chars: int, path: str | None = None) -> list[str]:
    train, _ = train_data.split(train_data.load_conversations(path))
    texts, total = [], 0
    for conv in train:
        text = train_data.chat_text(conv)
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train the byte-level BPE; returns a `tokenizers.Tokenizer` with ids 0..4 special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(train_data.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, need {vocab_size}")
    for i, tok in enumerate(train_data.SPECIAL_TOKENS):
        if tokenizer.token_to_id(tok) != i:
            raise RuntimeError(f"special token {tok} got id {tokenizer.token_to_id(tok)}, need {i}")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    default_out = os.path.join(os.path.dirname(__file__), "small_tokenizer.json")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    args = parser.parse_args(argv)
    build_tokenizer(training_texts(args.max_chars)).save(args.out, pretty=False)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
