"""AgentX-like agentic session trees: lengths drawn eagerly, token ids built on demand.

A tree is one user session: a main agent whose context grows turn by turn and, in 44.5% of trees,
sub-agent groups (each one sub-agent conversation of ~16 requests, run while the parent waits, as
a coding agent's task tool does). A driver lane replays a tree's requests in order. Every prompt
is three segments of synthetic token streams (see tokens.py):

    [ salt | system/tool prefix | context stream of this agent and compaction epoch ]
      tree   shared by all agents  context_k+1 = context_k + output_k + new_input_k+1
             of the tree

so the prefix a request shares with the previous request of its session (its ideal cache hit) is
that request's prompt plus its output. A sub-agent's first request shares salt + system prefix
with its parent. When a context would pass the tree's compaction threshold, the agent compacts:
a new stream starts with a summary and only salt + system prefix stay shared.

`scale` divides every token count (and the caps; `output_scale`, when given, divides output
lengths instead) and `time_scale` every think time, so small models and CPU runs keep the shape.
Everything is deterministic from the config: tree i depends only on (seed, i, scales, max_turns),
not on how many trees are generated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from flashpd.bench.laws import AgentShape, LogQuantiles
from flashpd.bench.tokens import Segment, TokenSpace, derive_key

FORMAT = "flashpd-agentx-workload-v1"
_SALT_TAG, _SYSTEM_TAG, _CONTEXT_TAG = 1, 2, 3
MAIN_AGENT = "main"


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    num_trees: int = 64
    scale: float = 1.0  # every token count (and the context cap) is divided by this
    time_scale: float = 1.0  # every think time is divided by this
    output_scale: float | None = None  # divides output lengths instead of `scale` when given
    max_turns: int | None = None  # caps main turns and a sub-agent group's requests
    vocab_lo: int = 1000  # synthetic ids are drawn from [vocab_lo, vocab_hi)
    vocab_hi: int = 128_000
    shape: AgentShape = field(default_factory=AgentShape)

    def __post_init__(self) -> None:
        if self.num_trees < 1:
            raise ValueError(f"num_trees must be >= 1, got {self.num_trees}")
        if not (self.scale >= 1.0 and self.time_scale > 0.0):
            raise ValueError(f"need scale >= 1 and time_scale > 0, got {self.scale}, {self.time_scale}")
        if self.output_scale is not None and self.output_scale < 1.0:
            raise ValueError(f"output_scale must be >= 1, got {self.output_scale}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        TokenSpace(self.vocab_lo, self.vocab_hi)  # validates the range

    def tokens(self, count: float) -> int:
        """A scale-1 token count at this scale (at least one token)."""
        return max(1, int(round(count / self.scale)))

    def tokens_array(self, counts: np.ndarray) -> list[int]:
        return np.maximum(1, np.rint(counts / self.scale)).astype(np.int64).tolist()

    def output_tokens_array(self, counts: np.ndarray) -> list[int]:
        scale = self.scale if self.output_scale is None else self.output_scale
        return np.maximum(1, np.rint(counts / scale)).astype(np.int64).tolist()

    def to_dict(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["shape"] = self.shape.to_dict()
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> WorkloadConfig:
        raw = dict(raw)
        shape = AgentShape.from_dict(raw.pop("shape"))
        return cls(shape=shape, **raw)


@dataclass(frozen=True, slots=True)
class Request:
    tree_id: int
    index: int  # position in the tree's replay order
    agent: str  # "main" or "sub<g>"
    session_id: str
    parent_session_id: str | None
    turn_index: int  # turn within its own session
    segments: tuple[Segment, ...]  # salt, system prefix, context
    new_input_tokens: int  # uncached input this turn (the whole context on a first turn)
    max_tokens: int  # fixed output length (sent with ignore_eos)
    think_s: float  # think time before this request is sent
    ideal_cached_tokens: int  # shared with the previous request of the session (or the parent)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens

    @property
    def is_subagent(self) -> bool:
        return self.agent != MAIN_AGENT


def session_id_for(session_prefix: str, agent: str) -> str:
    return session_prefix if agent == MAIN_AGENT else f"{session_prefix}/{agent}"


@dataclass(frozen=True)
class SessionTree:
    tree_id: int
    requests: tuple[Request, ...]

    def instantiate(self, salt_key: int, session_prefix: str) -> SessionTree:
        """The same tree with a new salt and session ids, so it shares no KV with other copies."""
        return SessionTree(self.tree_id, tuple(_resalt(r, salt_key, session_prefix) for r in self.requests))


def _resalt(request: Request, salt_key: int, session_prefix: str) -> Request:
    salt, *rest = request.segments
    parent = None if not request.is_subagent else session_id_for(session_prefix, MAIN_AGENT)
    return replace(
        request,
        segments=(Segment(salt_key, salt.num_tokens), *rest),
        session_id=session_id_for(session_prefix, request.agent),
        parent_session_id=parent,
    )


@dataclass(frozen=True)
class _TurnDraws:
    """Per-request random draws of one agent, already scaled (tokens) and time-scaled (s)."""

    new_input_tokens: list[int]
    output_tokens: list[int]
    think_s: list[float]
    summary_tokens: list[int]

    @classmethod
    def sample(cls, rng: np.random.Generator, config: WorkloadConfig, output_law: LogQuantiles, n: int) -> _TurnDraws:
        shape = config.shape
        return cls(
            new_input_tokens=config.tokens_array(shape.new_input_tokens.sample(rng, n)),
            output_tokens=config.output_tokens_array(output_law.sample(rng, n)),
            think_s=(shape.think_s.sample(rng, n) / config.time_scale).tolist(),
            summary_tokens=config.tokens_array(shape.summary_tokens.sample(rng, n)),
        )


class _AgentContext:
    """One agent's context as it grows and compacts (token counts already scaled)."""

    def __init__(
        self,
        prefix: tuple[Segment, Segment],
        stream_base: tuple[int, ...],
        compact_tokens: int,
        cap_tokens: int,
        first_shared_tokens: int,
    ) -> None:
        self.prefix = prefix
        self.prefix_tokens = sum(s.num_tokens for s in prefix)
        self.stream_base = stream_base
        self.compact_tokens = compact_tokens
        self.cap_tokens = cap_tokens
        self.first_shared_tokens = first_shared_tokens
        self.epoch = 0
        self.stream_key = derive_key(*stream_base, 0)
        self.turns = 0
        self.context_tokens = 0  # context-stream tokens in the last prompt
        self.last_output_tokens = 0

    def next_prompt(self, new_input: int, output: int, summary: int) -> tuple[tuple[Segment, ...], int, int]:
        """(segments, ideal cached tokens, new input tokens) of this agent's next request."""
        grown = self.context_tokens + self.last_output_tokens + new_input
        if self.turns > 0 and self.prefix_tokens + grown + output <= self.compact_tokens:
            shared = self.prefix_tokens + self.context_tokens + self.last_output_tokens
            context = grown
        else:
            if self.turns > 0:
                self.epoch += 1
                self.stream_key = derive_key(*self.stream_base, self.epoch)
            carried = summary if self.turns > 0 else 0
            new_input = self._fit_cap(carried, new_input, output)
            shared = self.first_shared_tokens if self.turns == 0 else self.prefix_tokens
            context = carried + new_input
        self.turns += 1
        self.context_tokens, self.last_output_tokens = context, output
        stream = Segment(self.stream_key, context)
        return (*self.prefix, stream), shared, new_input

    def _fit_cap(self, carried: int, new_input: int, output: int) -> int:
        room = self.cap_tokens - self.prefix_tokens - carried - output
        if room < 1:
            raise ValueError(
                f"context cap {self.cap_tokens} tokens cannot hold prefix {self.prefix_tokens} + "
                f"summary {carried} + output {output}: the scale is too coarse"
            )
        return min(new_input, room)


def _compaction_tokens(rng: np.random.Generator, shape: AgentShape) -> float:
    short = rng.random() < shape.short_window_share
    window = shape.short_window_compact_tokens if short else shape.long_window_compact_tokens
    return window.sample_one(rng)


def _count(law: LogQuantiles, rng: np.random.Generator, cap: int | None) -> int:
    n = max(1, int(round(law.sample_one(rng))))
    return n if cap is None else min(n, cap)


def _group_plan(rng: np.random.Generator, config: WorkloadConfig, num_turns: int) -> list[tuple[int, int]]:
    """(main turn the group follows, requests in the group), in replay order."""
    shape = config.shape
    if rng.random() >= shape.subagent_tree_share:
        return []
    num_groups = min(_count(shape.subagent_groups, rng, None), num_turns)
    after_turns = np.sort(rng.choice(num_turns, size=num_groups, replace=False))
    sizes = [_count(shape.subagent_group_requests, rng, config.max_turns) for _ in after_turns]
    return list(zip(after_turns.tolist(), sizes, strict=True))


def generate_tree(config: WorkloadConfig, tree_id: int) -> SessionTree:
    rng = np.random.default_rng([config.seed, tree_id])
    shape = config.shape
    num_turns = _count(shape.main_turns, rng, config.max_turns)
    system_tokens = config.tokens(shape.system_prefix_tokens.sample_one(rng))
    compact_tokens = config.tokens(_compaction_tokens(rng, shape))
    cap_tokens = config.tokens(shape.context_cap_tokens)
    groups = _group_plan(rng, config, num_turns)
    prefix = (
        Segment(derive_key(config.seed, tree_id, _SALT_TAG), config.tokens(shape.salt_tokens)),
        Segment(derive_key(config.seed, _SYSTEM_TAG), system_tokens),
    )

    def agent_context(agent_index: int, first_shared: int) -> _AgentContext:
        base = (config.seed, tree_id, _CONTEXT_TAG, agent_index)
        return _AgentContext(prefix, base, compact_tokens, cap_tokens, first_shared)

    builder = _TreeBuilder(tree_id, f"tree{tree_id}")
    main = agent_context(0, first_shared=0)
    main_draws = _TurnDraws.sample(rng, config, shape.main_output_tokens, num_turns)
    groups_after: dict[int, list[int]] = {}
    for after_turn, size in groups:
        groups_after.setdefault(after_turn, []).append(size)
    for turn in range(num_turns):
        builder.add(MAIN_AGENT, main, main_draws, turn, first_in_tree=turn == 0)
        for size in groups_after.get(turn, []):
            sub = agent_context(builder.num_groups + 1, first_shared=main.prefix_tokens)
            agent = f"sub{builder.num_groups}"
            draws = _TurnDraws.sample(rng, config, shape.sub_output_tokens, size)
            for sub_turn in range(size):
                builder.add(agent, sub, draws, sub_turn, first_in_tree=False)
            builder.num_groups += 1
    return SessionTree(tree_id, tuple(builder.requests))


class _TreeBuilder:
    def __init__(self, tree_id: int, session_prefix: str) -> None:
        self.tree_id = tree_id
        self.session_prefix = session_prefix
        self.requests: list[Request] = []
        self.num_groups = 0

    def add(self, agent: str, context: _AgentContext, draws: _TurnDraws, turn: int, first_in_tree: bool) -> None:
        output = draws.output_tokens[turn]
        segments, shared, new_input = context.next_prompt(
            draws.new_input_tokens[turn], output, draws.summary_tokens[turn]
        )
        parent = None if agent == MAIN_AGENT else session_id_for(self.session_prefix, MAIN_AGENT)
        self.requests.append(
            Request(
                tree_id=self.tree_id,
                index=len(self.requests),
                agent=agent,
                session_id=session_id_for(self.session_prefix, agent),
                parent_session_id=parent,
                turn_index=turn,
                segments=segments,
                new_input_tokens=new_input,
                max_tokens=output,
                think_s=0.0 if first_in_tree else draws.think_s[turn],
                ideal_cached_tokens=shared,
            )
        )


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    trees: tuple[SessionTree, ...]

    @property
    def token_space(self) -> TokenSpace:
        return TokenSpace(self.config.vocab_lo, self.config.vocab_hi)

    def requests(self) -> Iterator[Request]:
        for tree in self.trees:
            yield from tree.requests

    def prompt_ids(self, request: Request) -> list[int]:
        return self.token_space.prompt_ids(request.segments)

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as out:
            out.write(json.dumps({"format": FORMAT, "config": self.config.to_dict()}) + "\n")
            for request in self.requests():
                out.write(json.dumps(_request_to_json(request)) + "\n")

    @classmethod
    def read_jsonl(cls, path: str | Path) -> Workload:
        with open(path) as src:
            header = json.loads(src.readline())
            if header.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file (header {header.get('format')!r})")
            config = WorkloadConfig.from_dict(header["config"])
            by_tree: dict[int, list[Request]] = {}
            for line in src:
                request = _request_from_json(json.loads(line))
                by_tree.setdefault(request.tree_id, []).append(request)
        trees = tuple(SessionTree(tid, tuple(reqs)) for tid, reqs in by_tree.items())
        return cls(config, trees)


def generate_workload(config: WorkloadConfig) -> Workload:
    return Workload(config, tuple(generate_tree(config, i) for i in range(config.num_trees)))


_JSON_FIELDS = (
    "tree_id",
    "index",
    "agent",
    "session_id",
    "parent_session_id",
    "turn_index",
    "new_input_tokens",
    "max_tokens",
    "think_s",
    "ideal_cached_tokens",
)


def _request_to_json(request: Request) -> dict[str, Any]:
    row = {name: getattr(request, name) for name in _JSON_FIELDS}
    row["segments"] = [[s.stream_key, s.num_tokens] for s in request.segments]
    return row


def _request_from_json(row: dict[str, Any]) -> Request:
    segments = tuple(Segment(int(k), int(n)) for k, n in row["segments"])
    return Request(segments=segments, **{name: row[name] for name in _JSON_FIELDS})


def summarize(workload: Workload) -> dict[str, float]:
    """The workload's shape figures, to compare with workload.md (token counts at this scale)."""
    requests = list(workload.requests())
    main = [r for r in requests if not r.is_subagent]
    subs = [r for r in requests if r.is_subagent]
    followups = [r for r in requests if r.turn_index > 0]
    turns = [sum(1 for r in t.requests if not r.is_subagent) for t in workload.trees]
    groups = [len({r.agent for r in t.requests if r.is_subagent}) for t in workload.trees]
    group_sizes = _group_sizes(workload)

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else math.nan

    new_inputs = [r.new_input_tokens for r in followups]
    return {
        "trees": len(workload.trees),
        "requests": len(requests),
        "main_prompt_p50": pct([r.prompt_tokens for r in main], 50),
        "main_prompt_p90": pct([r.prompt_tokens for r in main], 90),
        "new_input_p50": pct(new_inputs, 50),
        "new_input_mean": float(np.mean(new_inputs)) if new_inputs else math.nan,
        "new_input_p99": pct(new_inputs, 99),
        "main_output_p50": pct([r.max_tokens for r in main], 50),
        "main_output_mean": float(np.mean([r.max_tokens for r in main])),
        "main_output_p90": pct([r.max_tokens for r in main], 90),
        "all_output_p50": pct([r.max_tokens for r in requests], 50),
        "turns_p50": pct(turns, 50),
        "turns_p90": pct(turns, 90),
        "think_p50_s": pct([r.think_s for r in followups], 50),
        "think_p90_s": pct([r.think_s for r in followups], 90),
        "think_p99_s": pct([r.think_s for r in followups], 99),
        "subagent_tree_share": float(np.mean([g > 0 for g in groups])),
        "subagent_groups_p50": pct([g for g in groups if g > 0], 50),
        "subagent_group_requests_p50": pct(group_sizes, 50),
        "subagent_prompt_p50": pct([r.prompt_tokens for r in subs], 50),
        "subagent_prompt_p90": pct([r.prompt_tokens for r in subs], 90),
        "ideal_hit_rate": sum(r.ideal_cached_tokens for r in requests) / sum(r.prompt_tokens for r in requests),
    }


def _group_sizes(workload: Workload) -> list[int]:
    sizes: dict[tuple[int, str], int] = {}
    for r in workload.requests():
        if r.is_subagent:
            sizes[(r.tree_id, r.agent)] = sizes.get((r.tree_id, r.agent), 0) + 1
    return list(sizes.values())


def add_tree_args(ap) -> None:
    """The session-tree arguments the CPU studies share (argparse; defaults of the CPU runs)."""
    ap.add_argument("--trees", type=int, default=16)
    ap.add_argument("--scale", type=float, default=500)
    ap.add_argument("--time-scale", type=float, default=50)
    ap.add_argument("--output-scale", type=float, default=40)
    ap.add_argument("--max-turns", type=int, default=12)
