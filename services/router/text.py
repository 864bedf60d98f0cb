"""The router's view of a tokenizer. Streaming detokenization (with stop strings) is the engine's
`flashpd.engine.detokenizer.TextStream`, shared with the engine CLI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...  # special tokens skipped

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]: ...
