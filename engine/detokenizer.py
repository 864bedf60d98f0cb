"""Incremental detokenisation with exact stop-string cuts.

Text is re-decoded from the output ids (cheap at these lengths, and exact for byte-level BPE,
where one token may hold half a UTF-8 character). Only the stable prefix (no trailing U+FFFD)
is released, and a suffix that could still grow into a stop string is held back, so a stop
string never leaks into streamed text.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopState:
    stop: tuple[str, ...]
    emitted_chars: int = 0  # characters of text already released to the client
    text: str = ""  # released text so far
    stopped: bool = False
    _held: str = field(default="", repr=False)


class Detokenizer:
    """Wraps a `tokenizers.Tokenizer` (or anything with `decode(ids) -> str`)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def step(self, state: StopState, output_ids: list[int]) -> str:
        """Return the newly released text after `output_ids` grew; sets `state.stopped` when a
        stop string appears (the text is then cut right before it)."""
        full = self.decode(output_ids)
        stable = full.rstrip("\ufffd")
        for s in state.stop:
            pos = stable.find(s)
            if pos != -1:
                state.stopped = True
                stable = stable[:pos]
        if not state.stopped:
            stable = stable[: len(stable) - _holdback(stable, state.stop)]
        new = stable[state.emitted_chars :] if len(stable) > state.emitted_chars else ""
        state.emitted_chars += len(new)
        state.text += new
        return new

    def flush(self, state: StopState, output_ids: list[int]) -> str:
        """At finish (not by a stop string): release whatever was held back."""
        if state.stopped:
            return ""
        full = self.decode(output_ids)
        new = full[state.emitted_chars :]
        state.emitted_chars += len(new)
        state.text += new
        return new


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best
