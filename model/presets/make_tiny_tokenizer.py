"""Generate model/presets/tiny_tokenizer.json: a 512-token byte-level BPE for the `tiny` preset.

    python -m flashpd.model.presets.make_tiny_tokenizer [--out PATH]

Ids 0..4 are special tokens (2 is the pad token, the Engram pad id); ids 5..260 are the 256
byte-level symbols, so any text encodes; the remaining 251 ids are merges learned on the English
corpus below. Training is single-threaded and deterministic, so rerunning reproduces the file.
"""

from __future__ import annotations

import argparse
import os

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>", "<|User|>", "<|Assistant|>"]
PAD_TOKEN_ID = 2

CORPUS = """
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a
language if the text it reads is varied and plain. This short corpus is written for a tiny test
tokenizer: it should hold the common words of English, numbers such as 1, 2, 3, 10, 42, 100 and
2024, punctuation, and a few lines of code, so that typical prompts split into sensible pieces.

Once upon a time there was a little town by the sea. The people of the town were fishermen and
farmers, bakers and teachers. Every morning the boats went out before the sun was up, and every
evening they came back with nets full of fish. The children walked to school along the harbour
wall and counted the gulls. In the winter the storms were strong, and the waves broke over the
wall, but in the summer the water was calm and blue and the tourists came to swim.

A computer is a machine that follows instructions. The instructions are called a program. A
program reads input, does some work, and writes output. Memory holds the data the program is
working on, and the processor runs one instruction after another, very quickly. Modern machines
have many processors, called cores, and graphics processors that can do thousands of small
calculations at the same time. Training a language model uses these processors for weeks.

How does a language model work? It reads a sequence of tokens and predicts the next one. Each
token is turned into a vector, the vectors pass through many layers of attention and feed
forward networks, and the last layer gives a score for every token in the vocabulary. The
model samples from these scores, appends the chosen token, and repeats until it is done.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you write a short poem about the rain?
Assistant: Soft rain on the roof, a quiet song at night; the street shines like glass.
User: How many days are there in a week?
Assistant: There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday,
Saturday and Sunday.
User: Please explain what a prime number is.
Assistant: A prime number is a whole number greater than one that has no divisors other than
one and itself. The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens

The weather today is sunny with a light wind from the west. Tomorrow there will be clouds in
the morning and rain in the afternoon. Temperatures will stay between twelve and eighteen
degrees. Remember to take an umbrella if you are going out in the evening.

She opened the old book and read the first page aloud. "It was the best of times, it was the
worst of times," she said, and smiled. Her brother asked what it meant, and she told him that
some stories begin by telling you everything and nothing at once. They read together until it
was dark, and then they went downstairs for dinner, where their mother had made soup and bread.

Science asks questions about the world and tests the answers with experiments. Water boils at
one hundred degrees at sea level. Light travels at about three hundred thousand kilometres per
second. The earth goes around the sun once a year, and the moon goes around the earth about
once a month. Plants use sunlight, water and air to make sugar, and release oxygen.

Good software is easy to read, easy to test and easy to change. Write small functions with
clear names. Check your inputs and fail loudly when something is wrong. Keep the data flowing in
one direction, and write a test for every behaviour you care about. When a test fails, read the
error message carefully: it usually tells you exactly where to look.

The market opened early. Traders called out prices for apples, oranges, potatoes and fresh
bread. A woman bought three loaves and a bag of flour; a man with a red hat asked for the price
of the cheese and then walked away. By noon most of the stalls were empty and the square was
quiet again, except for the pigeons looking for crumbs between the stones.
"""


def build_tokenizer():
    """Train the byte-level BPE on CORPUS; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    # Training threads only parallelise pair counting; counts (and so merges) are deterministic.
    tokenizer.train_from_iterator(CORPUS.strip().split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, need {VOCAB_SIZE}: the corpus is too small")
    for i, tok in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(tok) != i:
            raise RuntimeError(f"special token {tok} got id {tokenizer.token_to_id(tok)}, need {i}")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    default_out = os.path.join(os.path.dirname(__file__), "tiny_tokenizer.json")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args(argv)
    build_tokenizer().save(args.out, pretty=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
