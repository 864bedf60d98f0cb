"""Grammar-constrained sampling (structured outputs, enforced tool calls) with xgrammar.

    backend = GrammarBackend.from_tokenizer(tokenizer, vocab_size, eos_token_id)
    backend.compile(guided)                     # any thread; cached; GrammarError if it cannot
    m = backend.matcher(guided, replay_ids)     # the loop thread, per request (cheap)
    bitmask = fill_bitmask(backend, [m, None])  # [B, ceil(V / 32)] int32, one bit per token
    ... Sampler.launch(logits, rids, params, bitmask=bitmask) ...
    m.accept_token(sampled)                     # after the step's ids reach the host

Why xgrammar (not llguidance): vLLM and SGLang both default to it, so its JSON-schema coverage
is the one agent clients meet elsewhere; it ships a structural-tag format with DeepSeek V4.1's
DSML parameter style (`deepseek_v4_1_xml`), which is what enforcing `tool_choice`
required/named needs; its compiled grammars precompute per-state token masks (adaptive mask
cache), so the per-step cost is a bitmask fill, and compilation is done once per schema and
cached. llguidance compiles lazily (cheaper first use) but has no DSML parameter format.

Where it runs: compilation happens off the decode loop (the decode worker awaits `compile` in a
thread before reserving, so the loop only ever finds it cached); a matcher per request is made on
the loop thread (microseconds) and, for a continued or resumed stream, first accepts the tokens
the earlier attempt generated (`GuidedDecoding.replay_tokens`), so the grammar state is the one
the stream broke in.

Vocabulary: the tokenizer's byte-level BPE symbols in id order; its added special tokens (chat
markers, EOS) are entered as empty strings, which xgrammar treats as special: never allowed
inside structured output (EOS is the grammar's stop token, allowed once the output is
complete). Ids past the tokenizer (padding rows of the model's vocabulary) are never allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from flashpd.engine.sampling_params import GuidedDecoding, SamplingError

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (LRU); a JSON schema's is ~10-100 KB
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


class GrammarError(SamplingError):
    """The grammar cannot be compiled, or replayed tokens break it; `field` names the request
    field (response_format / tools / tool_choice)."""


class GrammarBackend:
    """Compiles guided-decoding specs for one tokenizer (thread-safe, LRU-cached) and makes a
    matcher per request."""

    def __init__(
        self,
        encoded_vocab: Sequence[str],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size  # the model's logits width (>= the tokenizer's)
        self.info = xgr.TokenizerInfo(
            list(encoded_vocab), xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self.num_compiles = 0  # compilations done (cache misses), for tests and metrics

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_token_id: int | None, **kwargs) -> GrammarBackend:
        """From an HF `tokenizers.Tokenizer` (byte-level BPE, as the presets ship)."""
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [""] * max(vocab.values(), default=-1)
        encoded.append("")
        for piece, token_id in vocab.items():
            encoded[token_id] = "" if piece in special else piece
        if len(encoded) > vocab_size:
            raise ValueError(f"tokenizer has {len(encoded)} tokens, model vocab {vocab_size}")
        stops = [] if eos_token_id is None else [eos_token_id]
        return cls(encoded, vocab_size, stops, **kwargs)

    # ------------------------------------------------------------------ compile (any thread)
    def is_compiled(self, guided: GuidedDecoding) -> bool:
        with self._lock:
            return guided.cache_key in self._cache

    def compile(self, guided: GuidedDecoding):
        """The compiled grammar (cached by kind, spec and strict); raises GrammarError."""
        key = guided.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile_uncached(guided)  # outside the lock: slow, and thread-safe
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, guided: GuidedDecoding):
        c = self._compiler
        try:
            if guided.kind == "json_object":  # any object, compact like json_schema below
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if guided.kind == "json_schema":
                # compact output (no free whitespace): a model cannot pad an object forever
                grammar = self._xgr.Grammar.from_json_schema(
                    guided.spec, any_whitespace=False, strict_mode=guided.strict
                )
                return c.compile_grammar(self._xgr.Grammar.from_ebnf(_json_string_fix(str(grammar))))
            json.loads(guided.spec)  # a clearer error than the engine's for broken JSON
            return c.compile_structural_tag(guided.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"cannot be compiled into a grammar: {_first_line(exc)}", field=guided.field) from None

    # ------------------------------------------------------------------ matchers (loop thread)
    def matcher(self, guided: GuidedDecoding, replay_ids: Sequence[int] = ()):
        """A fresh matcher that has accepted `replay_ids` (an earlier attempt's output)."""
        m = self._xgr.GrammarMatcher(self.compile(guided))
        for token_id in replay_ids:
            if not m.accept_token(int(token_id)):
                raise GrammarError(
                    f"the {len(replay_ids)} tokens generated before the stream broke do not follow the grammar",
                    field=guided.field,
                )
        return m

    def fill_bitmask(self, matchers: Sequence[object | None]) -> torch.Tensor | None:
        """[B, ceil(V / 32)] int32 on the host: bit t of row b allows token t; rows without a
        matcher allow everything. None when no row is guided."""
        if all(m is None for m in matchers):
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, m in enumerate(matchers):
            if m is None:
                bitmask[row].fill_(ALL_ALLOWED)
            elif m.is_terminated():  # only the stop token remains meaningful
                bitmask[row].fill_(0)
                for t in self.info.stop_token_ids:
                    bitmask[row, t // 32] |= _bit(t % 32)
            else:
                m.fill_next_token_bitmask(bitmask, row)
        return bitmask


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (maxLength/minLength) as
# [^"\\\r\n], which lets raw control characters through (invalid JSON; its unbounded strings
# exclude \0-\x1f). The same class with the control characters excluded, as RFC 8259 requires.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _json_string_fix(ebnf: str) -> str:
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


def _bit(k: int) -> int:
    """Bit k of an int32 word as a signed int32 value."""
    return -(1 << 31) if k == 31 else 1 << k


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, W] int32 words -> [B, vocab] bool (bit t % 32 of word t // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift, then one bit: sign-safe
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text[:300]
