"""Streaming detokenization with stop strings: the one implementation, used by the router (it
owns stop strings for served requests) and by the engine CLI. The engine itself streams token ids
and stops only on EOS and stop token ids.

Incremental over a small window (cost per token independent of output length):

    ids:  ... | prefix_offset ........ read_offset | new ids |
                 '-- decoded once more, so merges across the boundary come out right

Text ending in U+FFFD (half a UTF-8 character) is not released until the next token completes
it. Released text is then checked for stop strings; a suffix that could still grow into a stop
string is held back, so a stop string never leaks into the stream.

Special tokens never show: the tokenizer's `decode` skips them (the router's served tokenizer
does; so does a `tokenizers.Tokenizer`, whose `decode` skips them by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...  # special tokens skipped


class TextStream:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded so far (released + held)
        self._released = 0  # characters of _text handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return newly released text. Sets `stopped` when a stop
        string completed (the text is cut right before it)."""
        if self.stopped:
            raise RuntimeError("push after a stop string matched")
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._tok.decode(self._ids[self._prefix_offset :])
        if window_text.endswith(REPLACEMENT_CHAR) or len(window_text) < len(prefix_text):
            return ""  # incomplete character: wait for the next token
        self._text += window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """At the end of generation (not by a stop string): release everything held back."""
        if self.stopped:
            return ""
        if self._read_offset < len(self._ids):  # trailing incomplete character, released as is
            prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            self._text += self._tok.decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
            self._read_offset = len(self._ids)
        out = self._text[self._released :]
        self._released = len(self._text)
        return out

    def _release(self) -> str:
        end = len(self._text)
        search_from = max(0, self._released - max((len(s) for s in self._stop), default=0))
        for s in self._stop:
            pos = self._text.find(s, search_from)
            if pos != -1 and pos < end:
                end, self.stopped = pos, True
        if not self.stopped:
            end -= _holdback(self._text, self._stop)
        out = self._text[self._released : end] if end > self._released else ""
        self._released += len(out)
        return out


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
