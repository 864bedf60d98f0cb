"""The one set of sampling parameters: built by the router's validation model
(`services/router/validation.py`), carried by the wire types (`services/api.py`), read by the
scheduler (`max_tokens`, `ignore_eos`, `stop_token_ids`) and the sampler. No torch, so the
router and the pure core can hold it.

Every construction validates (NaN and infinities refused, seeds in [0, 2^63 - 1], logprobs in
[0, 20]); a refusal is a `SamplingError` naming the field. Temperatures below
`GREEDY_TEMPERATURE` sample greedily. `stop` strings are applied by whoever holds the text (the
router, or the engine CLI), never by the engine: it stops on EOS and `stop_token_ids` only.

`guided` (structured outputs, tool calls) names a grammar the sampler masks tokens with
(`engine/grammar.py`); it is plain data here, compiled where tokens are sampled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is argmax in all but name
MAX_SEED = 2**63 - 1  # seeds travel as int64 (torch.Generator.manual_seed)
MAX_LOGPROBS = 20
GUIDED_KINDS = ("json_object", "json_schema", "structural_tag")
MAX_GUIDED_SPEC_CHARS = 1 << 20
SPECULATIVE_MODES = (
    "auto",
    "off",
)  # per request: the engine's policy decides, or never  # a schema / structural tag as JSON text


class SamplingError(ValueError):
    """A sampling parameter is invalid; `field` names it."""

    def __init__(self, message: str, *, field: str) -> None:
        self.message, self.field = message, field
        super().__init__(f"{field} {message}")

    def __reduce__(self):  # keep `field` through pickling
        return (_rebuild_error, (self.message, self.field))


def _rebuild_error(message: str, field: str) -> SamplingError:
    return SamplingError(message, field=field)


@dataclass(frozen=True)
class GuidedDecoding:
    """A grammar the sampled tokens must follow.

    kind "json_object": any JSON object; "json_schema": `spec` is the schema as JSON text
    (`strict` refuses keywords the grammar engine cannot enforce instead of ignoring them);
    "structural_tag": `spec` is an xgrammar structural tag as JSON text (tool calls).
    `replay_tokens`: the last that many prompt tokens were generated under this grammar by an
    earlier attempt of the same request (a continued or resumed stream): the matcher accepts
    them before the first sample, so the grammar state resumes where the stream broke."""

    kind: str
    spec: str = ""
    strict: bool = True
    replay_tokens: int = 0
    field: str = "response_format"  # the request field an invalid grammar is reported under

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise SamplingError(f"kind must be one of {list(GUIDED_KINDS)}, got {self.kind!r}", field=self.field)
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDED_SPEC_CHARS:
            raise SamplingError(f"must be JSON text of at most {MAX_GUIDED_SPEC_CHARS} characters", field=self.field)
        if (self.kind == "json_object") != (self.spec == ""):
            raise SamplingError(f"{self.kind} {'takes no' if self.spec else 'needs a'} spec", field=self.field)
        if not (_is_int(self.replay_tokens) and self.replay_tokens >= 0):
            raise SamplingError("replay_tokens must be an integer >= 0", field=self.field)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (not the replay)."""
        return self.kind, self.spec, self.strict


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, applied where the text is (router, CLI)
    ignore_eos: bool = False
    logprobs: int = 0  # top-n logprobs per sampled token (0 = off)
    guided: GuidedDecoding | None = None  # grammar mask (structured outputs, tool calls)
    speculative: str = "auto"  # "off": never draft for this request (engine/speculative.py)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise SamplingError for the first invalid field (also for an unpickled copy, whose
        __post_init__ did not run)."""
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"),
            (
                _is_real(self.temperature) and 0.0 <= self.temperature < math.inf,
                "temperature",
                "must be a finite number >= 0",
            ),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0"),
            (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (
                self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
                "seed",
                f"must be null or an integer in [0, {MAX_SEED}]",
            ),
            (
                _is_seq(self.stop_token_ids) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be token ids >= 0",
            ),
            (
                _is_seq(self.stop) and all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "must be non-empty strings",
            ),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean"),
            (
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.guided is None or isinstance(self.guided, GuidedDecoding),
                "guided",
                "must be null or a GuidedDecoding",
            ),
            (self.speculative in SPECULATIVE_MODES, "speculative", f"must be one of {list(SPECULATIVE_MODES)}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise SamplingError(f"{rule}, got {getattr(self, name)!r}", field=name)
        if self.guided is not None:
            self.guided.check()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """From JSON-like fields (lists for the tuples); unknown names are refused."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise SamplingError(f"unknown field(s): {', '.join(unknown)}", field=unknown[0])
        d = dict(d)
        for key in ("stop_token_ids", "stop"):
            if key in d:
                d[key] = () if d[key] is None else (d[key],) if isinstance(d[key], str) else tuple(d[key])
        if isinstance(d.get("guided"), dict):
            d["guided"] = GuidedDecoding(**d["guided"])
        return cls(**d)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stop_token_ids"], out["stop"] = list(self.stop_token_ids), list(self.stop)
        return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _is_seq(value: object) -> bool:
    return isinstance(value, tuple | list)
