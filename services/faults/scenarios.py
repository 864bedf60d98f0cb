"""The fault scenarios of issue 15, each against a deployed `FaultStack`, each returning counts.

A scenario never asserts: it measures and returns a `ScenarioResult` whose `failures` list says
what missed the issue's bar (empty = passed). The pytest suite asserts on that list; the CLI
prints and records it. Clients are the real ones: the SDK (gRPC), httpx (OpenAI HTTP), raw gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from flashpd.services.faults.stack import FaultStack

TIMEOUT_S = 300.0  # per request, generous: a 2-core machine under a storm is slow


@dataclass
class ScenarioResult:
    name: str
    counts: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # what missed the bar

    @property
    def passed(self) -> bool:
        return not self.failures

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {
        "p50": round(pick(0.50), 3),
        "p90": round(pick(0.90), 3),
        "p99": round(pick(0.99), 3),
        "max": round(s[-1], 3),
    }


def _code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.aio.AioRpcError: code() is a method
        return f"{type(exc).__name__} {code().name}"
    return getattr(code, "name", None) or type(exc).__name__


async def generate(client, ids: list[int], *, max_tokens: int, **kw) -> dict:
    """One SDK request: its outcome, TTFT and result (or error code)."""
    started = time.monotonic()
    ttft = None
    try:
        stream = client.generate(
            prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw
        )
        async for _ in stream:
            if ttft is None:
                ttft = time.monotonic() - started
        return {"ok": True, "ttft_s": ttft, "e2e_s": time.monotonic() - started, "result": stream.result}
    except Exception as exc:  # counted, not raised: the scenario reports it
        return {"ok": False, "code": _code(exc), "error": str(exc)[:200]}


def _worker_ids(stack: FaultStack) -> set[str]:
    return {w.worker_id for w in stack.worker_stats()}


# ------------------------------------------------------------------------------------ fuzz


async def fuzz(stack: FaultStack, *, seed: int = 0, limit: int | None = None) -> ScenarioResult:
    """Hostile requests (helper B's generator) over HTTP and gRPC: 0 server errors, 0 internals
    in bodies, 0 engine deaths, still serving afterwards."""
    import grpc
    import httpx

    from flashpd.services.router.fuzz_cases import hostile_requests
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("fuzz")
    async with AsyncClient(stack.grpc_target) as client:
        vocab = (await client.models())[0].vocab_size
    cases = hostile_requests(seed, vocab_size=vocab)[:limit]
    before = _worker_ids(stack)
    problems: list[str] = []
    outcomes: Counter = Counter()
    async with (
        httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http,
        grpc.aio.insecure_channel(stack.grpc_target) as channel,
    ):
        for case in cases:
            problem = await _send_hostile(http, channel, case, outcomes)
            if problem is not None:
                problems.append(problem)
    after = _worker_ids(stack)
    res.counts = {
        "requests": len(cases),
        "problems": len(problems),
        "engine_deaths": len(before - after),
        **dict(sorted(outcomes.items())),
    }
    res.counts["examples"] = problems[:5]
    res.check(not problems, f"{len(problems)} answers were server errors or leaked internals")
    res.check(before == after, f"workers died: {sorted(before - after)}")
    alive = await _serving(stack)
    res.check(alive, "not serving after the fuzz run")
    return res


async def _send_hostile(http, channel, case, outcomes: Counter) -> str | None:
    """Send one hostile request over its protocol, count its outcome; the problem, if any."""
    from flashpd.services.router.fuzz_cases import grpc_verdict, http_verdict

    if case.protocol == "http":
        r = await http.request(case.method, case.path, headers=list(case.headers), content=case.body)
        outcomes[f"http {r.status_code // 100}xx"] += 1
        return http_verdict(case, r.status_code, r.content)
    code, details, fld = await raw_grpc(channel, case.grpc_method, case.grpc_payload)
    outcomes[f"grpc {code}"] += 1
    return grpc_verdict(case, code, details, fld)


async def raw_grpc(channel, method: str, payload: bytes) -> tuple[str, str, str | None]:
    """(status code name, details, flashpd-field) of one call with raw request bytes."""
    import grpc

    try:
        if method.endswith("/Generate"):
            call = channel.unary_stream(method)(payload, timeout=60)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(method)(payload, timeout=60)
        return "OK", "", None
    except grpc.aio.AioRpcError as exc:
        fld = dict(exc.trailing_metadata() or ()).get("flashpd-field")
        return exc.code().name, exc.details() or "", fld


async def _serving(stack: FaultStack) -> bool:
    from flashpd_sdk import AsyncClient

    async with AsyncClient(stack.grpc_target) as client:
        out = await generate(client, [5, 6, 7, 8], max_tokens=2, timeout_s=60)
    return out["ok"]


# ----------------------------------------------------------------------------- cancel storm


async def cancel_storm(
    stack: FaultStack, *, n: int = 200, concurrency: int = 8, seed: int = 0, idle_within_s: float = 5.0
) -> ScenarioResult:
    """`n` streams cancelled at random points (SDK cancel, HTTP disconnect, raw gRPC cancel),
    while a prober keeps sending small requests: requests served throughout, back to idle
    within `idle_within_s`, 0 blocks leaked."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("cancel_storm")
    rng = random.Random(seed)
    vocab = await vocab_size(stack)
    probe = {"ok": 0, "failed": 0}
    stop = asyncio.Event()
    async with AsyncClient(stack.grpc_target) as client:
        prober = asyncio.create_task(_probe(client, probe, stop))
        outcomes = await _storm(stack, client, n=n, concurrency=concurrency, seed=seed, vocab=vocab, rng=rng)
        stop.set()
        await prober
    idle_s = await asyncio.to_thread(stack.wait_idle, idle_within_s)
    leaked = 0 if idle_s is not None else stack.blocks_held()
    if idle_s is None:  # how long it takes at all (reported, still a miss)
        late = await asyncio.to_thread(stack.wait_idle, 60.0)
        res.counts["idle_after_s"] = None if late is None else round(idle_within_s + late, 2)
    res.counts.update(
        {
            "streams": n,
            **dict(sorted(outcomes.items())),
            "probe_ok": probe["ok"],
            "probe_failed": probe["failed"],
            "idle_within_s": None if idle_s is None else round(idle_s, 2),
            "blocks_held_after": leaked,
        }
    )
    res.check(
        probe["failed"] == 0 and probe["ok"] > 0, f"prober: {probe['failed']} of {probe['ok'] + probe['failed']} failed"
    )
    res.check(idle_s is not None, f"not idle within {idle_within_s} s ({leaked} blocks held)")
    bad = {k: v for k, v in outcomes.items() if k.startswith("error")}
    res.check(not bad, f"storm requests failed other than by cancel: {bad}")
    return res


async def _storm(
    stack: FaultStack, client, *, n: int, concurrency: int, seed: int, vocab: int, rng: random.Random
) -> Counter:
    """`n` streams, `concurrency` at a time, each cancelled after 0-23 tokens by the SDK, an
    HTTP disconnect or a raw gRPC cancel in turn: how each ended."""
    outcomes: Counter = Counter()
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        ids = prompt_ids(random.Random(seed * 1000 + i), rng.randrange(100, 600), vocab)
        after_tokens = rng.randrange(0, 24)
        mode = ("sdk", "http", "grpc")[i % 3]
        async with sem:
            outcomes[await _cancelled_stream(stack, client, mode, ids, after_tokens)] += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


async def _probe(client, probe: dict, stop: asyncio.Event) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        out = await generate(client, prompt_ids(rng, 32, 200), max_tokens=2, timeout_s=60)
        probe["ok" if out["ok"] else "failed"] += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def _cancelled_stream(stack: FaultStack, client, mode: str, ids: list[int], after_tokens: int) -> str:
    """Open a stream, read `after_tokens` tokens (0: cancel before the first), cancel it;
    the outcome: "cancelled <mode>", "finished <mode>" or "error <mode> <code>"."""
    try:
        if mode == "sdk":
            done = await _sdk_cancel(client, ids, after_tokens)
        elif mode == "http":
            done = await _http_disconnect(stack, ids, after_tokens)
        else:
            done = await _grpc_cancel(stack, ids, after_tokens)
    except Exception as exc:
        return f"error {mode} {_code(exc)}"
    return f"{'finished' if done else 'cancelled'} {mode}"


async def _sdk_cancel(client, ids: list[int], after_tokens: int) -> bool:
    from flashpd_sdk import Cancelled

    stream = client.generate(prompt_ids=ids, max_tokens=64, ignore_eos=True, timeout_s=TIMEOUT_S)

    async def read() -> bool:
        got = 0
        try:
            async for chunk in stream:
                got += len(chunk.token_ids)
                if after_tokens and got >= after_tokens:
                    stream.cancel()
        except Cancelled:
            return False
        return True

    reader = asyncio.create_task(read())
    if after_tokens == 0:  # cancel before the first token (while routing or prefilling)
        await asyncio.sleep(0.2)
        stream.cancel()
    finished = await reader
    await stream.aclose()
    return finished


async def _http_disconnect(stack: FaultStack, ids: list[int], after_tokens: int) -> bool:
    import httpx

    body = {"prompt": ids, "max_tokens": 64, "ignore_eos": True, "stream": True}
    got = 0
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=TIMEOUT_S) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return True
                if line.startswith("data: ") and "error" not in json.loads(line[6:]):
                    got += 1
                    if got >= after_tokens:
                        return False  # leaving the block hangs up mid-stream
    return True


async def _grpc_cancel(stack: FaultStack, ids: list[int], after_tokens: int) -> bool:
    import grpc

    from flashpd_sdk._gen import flashpd_pb2 as pb
    from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        req = pb.GenerateRequest(max_tokens=64, ignore_eos=True)
        req.prompt_ids.ids.extend(ids)
        call = pb_grpc.GenerationStub(channel).Generate(req, timeout=TIMEOUT_S)
        got = 0
        try:
            async for msg in call:
                if msg.WhichOneof("kind") == "final":
                    return True
                got += len(msg.chunk.token_ids)
                if got >= after_tokens:
                    call.cancel()  # no Abort RPC: the server must notice the cancel itself
        except asyncio.CancelledError:
            return False
        return call.cancelled() is False


async def vocab_size(stack: FaultStack) -> int:
    from flashpd_sdk import AsyncClient

    async with AsyncClient(stack.grpc_target) as client:
        return (await client.models())[0].vocab_size


# ---------------------------------------------------------------------------- prefill kill


async def prefill_kill(
    stack: FaultStack, *, n: int = 20, concurrency: int = 4, prompt_tokens: int = 1500, seed: int = 1
) -> ScenarioResult:
    """Kill a prefill replica while it prefills (`n` requests, `concurrency` in flight): every
    request completes (re-prefilled elsewhere or after the replacement registers)."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("prefill_kill")
    vocab = await vocab_size(stack)
    sem = asyncio.Semaphore(concurrency)
    outs: list[dict] = []
    async with AsyncClient(stack.grpc_target) as client:

        async def one(i: int) -> None:
            ids = prompt_ids(random.Random(seed * 1000 + i), prompt_tokens, vocab)
            async with sem:
                outs.append(await generate(client, ids, max_tokens=8))

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        victim = await _busy_worker(stack, "prefill", lambda w: w.queued_prefill_tokens > 0)
        if victim is not None:
            stack.kill_replica("prefill", victim)
        await asyncio.gather(*tasks)
    ok = [o for o in outs if o["ok"]]
    codes = Counter(o["code"] for o in outs if not o["ok"])
    res.counts = {
        "requests": n,
        "completed": len(ok),
        "failed": dict(codes),
        "killed": victim,
        "killed_mid_prefill": victim is not None,
        "ttft_s": percentiles([o["ttft_s"] for o in ok if o["ttft_s"] is not None]),
    }
    res.counts["router_retries"] = await router_counter(stack, "flashpd:request_retries_total")
    res.check(victim is not None, "no prefill worker was seen prefilling (nothing killed)")
    res.check(len(ok) == n, f"{n - len(ok)} of {n} failed: {dict(codes)}")
    return res


async def _busy_worker(stack: FaultStack, role: str, busy, timeout_s: float = 120.0):
    """The id of a `role` worker whose heartbeat shows work (`busy(stats)`), polled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in await asyncio.to_thread(stack.worker_stats):
            if w.role == role and busy(w):
                return w.worker_id
        await asyncio.sleep(0.05)
    return None


# ----------------------------------------------------------------------------- decode kill


async def decode_kill(
    stack: FaultStack, *, streams: int = 3, max_tokens: int = 64, kill_after_tokens: int = 5, seed: int = 2
) -> ScenarioResult:
    """Greedy streams of one session, all on its decode worker (`streams` through the SDK, one
    more as OpenAI HTTP SSE, one as raw gRPC); that worker is killed after each stream got
    `kill_after_tokens`: every stream completes with output identical to an unbroken run, and
    the session's next turn works on another decode worker.

    The continuation's prefill recomputes only the original prompt's KV (at the original
    credit) and the new decode worker replays from the prompt boundary and recomputes the
    streamed tokens, so its output equals the unbroken run's with the default 128-token bounded
    replay as well as with exact replay (`matching_tokens` says how far each stream matched)."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("decode_kill")
    vocab = await vocab_size(stack)
    rng = random.Random(seed)
    prompts = [prompt_ids(rng, 200, vocab) for _ in range(streams + 2)]  # HTTP, then gRPC
    session = f"dk-{seed}-{time.time_ns()}"
    async with AsyncClient(stack.grpc_target) as client:
        reference = [await generate(client, p, max_tokens=max_tokens) for p in prompts]
        warm = await generate(client, prompt_ids(rng, 64, vocab), max_tokens=2, session_id=session)
        if not (warm["ok"] and all(r["ok"] for r in reference)):
            res.check(False, "reference runs failed on the healthy stack")
            return res
        refs = [r["result"] for r in reference]
        bound = warm["result"].decode_worker
        run = await _streams_through_kill(stack, client, prompts, refs, max_tokens, session, bound, kill_after_tokens)
        run.after = await generate(client, prompt_ids(rng, 64, vocab), max_tokens=2, session_id=session)
    res.counts = _kill_counts(run)
    res.counts["router_retries"] = await router_counter(stack, "flashpd:request_retries_total")
    _check_kill(res, run, max_tokens)
    return res


@dataclass
class _KillRun:
    """What decode_kill saw: the session's streams through the kill of its decode worker."""

    bound: str  # the session's decode worker (the one killed)
    refs: list  # the unbroken runs' results: the SDK streams', then the HTTP one's, then gRPC's
    sdk_outs: list[dict]
    http_out: dict
    grpc_out: dict
    snapshot: list[int] | None  # each stream's tokens at the kill (None: nothing was killed)
    after: dict | None = None  # the session's next turn

    @property
    def identical(self) -> list[bool]:
        return [
            f["ok"] and f["result"].output_ids == r.output_ids for f, r in zip(self.sdk_outs, self.refs, strict=False)
        ]

    @property
    def moved(self) -> list[bool]:
        return [f["ok"] and f["result"].decode_worker != self.bound for f in self.sdk_outs]

    @property
    def http_identical(self) -> bool:
        return self.http_out["ok"] and self.http_out["text"] == self.refs[len(self.sdk_outs)].text

    @property
    def grpc_identical(self) -> bool:
        return self.grpc_out["ok"] and tuple(self.grpc_out["ids"]) == self.refs[len(self.sdk_outs) + 1].output_ids


async def _streams_through_kill(
    stack: FaultStack,
    client,
    prompts: list,
    refs: list,
    max_tokens: int,
    session: str,
    bound: str,
    kill_after_tokens: int,
) -> _KillRun:
    """The SDK streams, then one HTTP SSE and one raw gRPC stream, with `bound` killed once
    each got `kill_after_tokens` tokens."""
    streams = len(prompts) - 2
    progress = [0] * len(prompts)
    outs = await asyncio.gather(
        *(_tracked(client, p, max_tokens, session, progress, i) for i, p in enumerate(prompts[:streams])),
        _tracked_http(stack, prompts[streams], max_tokens, session, progress, streams),
        _tracked_grpc(stack, prompts[streams + 1], max_tokens, session, progress, streams + 1),
        _kill_when(stack, bound, progress, kill_after_tokens),
    )
    return _KillRun(bound, refs, list(outs[:streams]), outs[streams], outs[streams + 1], outs[-1])


def _kill_counts(run: _KillRun) -> dict:
    sdk_outs, bound = run.sdk_outs, run.bound
    return {
        "streams": len(sdk_outs),
        "killed": bound if run.snapshot else None,
        "tokens_before_kill": run.snapshot,
        "completed": sum(f["ok"] for f in sdk_outs),
        "identical": sum(run.identical),
        "matching_tokens": [
            _common_prefix(f["result"].output_ids, r.output_ids) if f["ok"] else 0
            for f, r in zip(sdk_outs, run.refs, strict=False)
        ],
        "resumed_elsewhere": sum(run.moved),
        "failed": [f.get("code") for f in sdk_outs if not f["ok"]],
        **_kill_edge_counts(run),
        "next_turn_ok": run.after["ok"],
        "next_turn_rebound": run.after["ok"] and run.after["result"].decode_worker != bound,
    }


def _kill_edge_counts(run: _KillRun) -> dict:
    """The OpenAI SSE stream's and the raw gRPC stream's outcomes."""
    http_out, grpc_out = run.http_out, run.grpc_out
    return {
        "http_sse_completed": http_out["ok"],
        "http_sse_identical_text": run.http_identical,
        "http_sse_resumed_elsewhere": http_out.get("decode_worker") not in (None, run.bound),
        "grpc_completed": grpc_out["ok"],
        "grpc_identical": run.grpc_identical,
        "grpc_resumed_elsewhere": grpc_out.get("decode_worker") not in (None, run.bound),
    }


def _check_kill(res: ScenarioResult, run: _KillRun, max_tokens: int) -> None:
    streams, identical, snapshot = len(run.sdk_outs), run.identical, run.snapshot
    res.check(snapshot is not None and max(snapshot) < max_tokens, "the decode worker was not killed mid-stream")
    res.check(all(identical), f"{streams - sum(identical)} of {streams} streams differ or failed")
    res.check(all(run.moved), "not every stream was resumed on another decode worker")
    res.check(run.http_identical, f"the HTTP SSE stream differs or failed: {run.http_out.get('error')}")
    res.check(run.grpc_identical, f"the raw gRPC stream differs or failed: {run.grpc_out.get('error')}")
    res.check(res.counts["next_turn_rebound"], "the session's next turn did not rebind")


async def _tracked_http(stack: FaultStack, ids, max_tokens, session, progress, i) -> dict:
    """An OpenAI completions SSE stream: its text and the decode worker of its last chunk."""
    import httpx

    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }  # OpenAI's default is 1: greedy must be asked for
    text, worker = [], None
    try:
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=TIMEOUT_S) as http:
            async with http.stream("POST", "/v1/completions", json=body, headers={"x-session-id": session}) as r:
                if r.status_code != 200:
                    return {"ok": False, "error": f"HTTP {r.status_code}"}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"ok": False, "error": chunk["error"].get("message")}
                    text.append(chunk["choices"][0].get("text", ""))
                    progress[i] += 1
                    worker = chunk.get("flashpd", {}).get("decode_worker", worker)
    except Exception as exc:
        return {"ok": False, "error": _code(exc)}
    return {"ok": True, "text": "".join(text), "decode_worker": worker}


async def _tracked_grpc(stack: FaultStack, ids, max_tokens, session, progress, i) -> dict:
    """A raw gRPC stream (no SDK: no client-side retry or resume): its ids and decode worker."""
    import grpc

    from flashpd_sdk._gen import flashpd_pb2 as pb
    from flashpd_sdk._gen import flashpd_pb2_grpc as pb_grpc

    out: list[int] = []
    try:
        async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
            req = pb.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, session_id=session)
            req.prompt_ids.ids.extend(ids)
            async for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=TIMEOUT_S):
                if msg.WhichOneof("kind") == "final":
                    return {"ok": True, "ids": out, "decode_worker": msg.final.decode_worker}
                out.extend(msg.chunk.token_ids)
                progress[i] += len(msg.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return {"ok": False, "error": f"{exc.code().name}: {exc.details()}"}
    return {"ok": False, "error": "the stream ended without a final message"}


async def _tracked(client, ids, max_tokens, session, progress, i) -> dict:
    try:
        stream = client.generate(
            prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, session_id=session, timeout_s=TIMEOUT_S
        )
        async for chunk in stream:
            progress[i] += len(chunk.token_ids)
        return {"ok": True, "result": stream.result}
    except Exception as exc:
        return {"ok": False, "code": _code(exc)}


async def _kill_when(
    stack: FaultStack, worker_id: str, progress: list[int], after: int, role: str = "decode"
) -> list[int] | None:
    """Kill once every stream got `after` tokens; the tokens each had then (None: no kill)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if all(p >= after for p in progress):
            snapshot = list(progress)
            stack.kill_replica(role, worker_id)
            return snapshot
        await asyncio.sleep(0.005)
    return None


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -------------------------------------------------------------------------- colocated kill


async def colocated_kill(
    stack: FaultStack, *, streams: int = 3, max_tokens: int = 40, kill_after_tokens: int = 5, seed: int = 5
) -> ScenarioResult:
    """Colocated mode: greedy streams of one session, all on its colocated worker, which is
    killed once each got `kill_after_tokens`. Every stream ends cleanly: complete (continued on
    another replica, which re-prefills prompt + the released tokens) or a clear UNAVAILABLE,
    never an internal error; the tokens before the kill are the unbroken run's; the session's
    next turn works, the replacement registers and no block stays held."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("colocated_kill")
    vocab = await vocab_size(stack)
    rng = random.Random(seed)
    prompts = [prompt_ids(rng, 200, vocab) for _ in range(streams)]
    session = f"ck-{seed}-{time.time_ns()}"
    async with AsyncClient(stack.grpc_target) as client:
        refs = [await generate(client, p, max_tokens=max_tokens) for p in prompts]
        warm = await generate(client, prompt_ids(rng, 64, vocab), max_tokens=2, session_id=session)
        if not (warm["ok"] and all(r["ok"] for r in refs)):
            res.check(False, "reference runs failed on the healthy stack")
            return res
        bound, progress = warm["result"].decode_worker, [0] * streams
        outs = await asyncio.gather(
            *(_tracked(client, p, max_tokens, session, progress, i) for i, p in enumerate(prompts)),
            _kill_when(stack, bound, progress, kill_after_tokens, role="colocated"),
        )
        after = await generate(client, prompt_ids(rng, 64, vocab), max_tokens=2, session_id=session)
    await asyncio.to_thread(stack.wait_ready, 300.0)
    idle_s = await asyncio.to_thread(stack.wait_idle, 30.0)
    _check_colocated_kill(res, outs[:streams], [r["result"] for r in refs], outs[-1], after, max_tokens)
    res.counts.update(killed=bound, idle_after_s=None if idle_s is None else round(idle_s, 2))
    res.check(idle_s is not None, f"blocks still held 30 s after the kill ({stack.blocks_held()})")
    return res


def _check_colocated_kill(res: ScenarioResult, outs, refs, snapshot, after, max_tokens: int) -> None:
    done = [o for o in outs if o["ok"]]
    codes = [o["code"] for o in outs if not o["ok"]]
    matching = [
        _common_prefix(o["result"].output_ids, r.output_ids) if o["ok"] else 0 for o, r in zip(outs, refs, strict=True)
    ]
    res.counts.update(
        streams=len(outs),
        tokens_before_kill=snapshot,
        completed=len(done),
        failed=codes,
        matching_tokens=matching,
        next_turn_ok=after["ok"],
    )
    res.check(snapshot is not None and max(snapshot) < max_tokens, "the colocated worker was not killed mid-stream")
    res.check(all(len(o["result"].output_ids) == max_tokens for o in done), "a completed stream lost tokens")
    res.check(all("UNAVAILABLE" in c or c == "Unavailable" for c in codes), f"streams ended unclearly: {codes}")
    before = snapshot or [0] * len(outs)
    res.check(
        all(m >= b or not o["ok"] for m, b, o in zip(matching, before, outs, strict=True)),
        "tokens before the kill differ",
    )
    res.check(after["ok"], f"the session's next turn failed: {after.get('code')}")


# ---------------------------------------------------------------------------- decode drain


# tokens a stream may have beyond the client's count when a drain starts (CI at aaf584a: a stream
# seen at 15 of 16 tokens finished on the drained replica: its last token was already made)
DRAIN_IN_FLIGHT_TOKENS = 2


async def decode_drain(
    stack: FaultStack,
    *,
    streams: int = 32,
    prompt_tokens: int = 160,
    max_tokens: int = 12,
    drain_after_tokens: int = 3,
    seed: int = 6,
) -> ScenarioResult:
    """`streams` greedy SDK streams on 1 prefill + 2 decode replicas; once each got
    `drain_after_tokens` tokens, the decode replica holding the most sequences is marked
    draining (`flashpd drain`'s Redis mark): every stream completes with output identical to
    an undisturbed run (0 errors), those on the drained replica move to the other one (live
    migration: 0 re-prefills, 0 retries), the drained replica ends with nothing held, and
    requests sent after the mark never land on it."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("decode_drain")
    vocab = await vocab_size(stack)
    rng = random.Random(seed)
    prompts = [prompt_ids(rng, prompt_tokens, vocab) for _ in range(streams)]
    async with AsyncClient(stack.grpc_target) as client:
        reference = await asyncio.gather(*(generate(client, p, max_tokens=max_tokens) for p in prompts))
        if not all(r["ok"] for r in reference):
            res.check(False, "reference runs failed on the healthy stack")
            return res
        refs = [r["result"].output_ids for r in reference]
        run = await _streams_through_drain(stack, client, prompts, refs, max_tokens, drain_after_tokens)
        if run.victim:
            run.late = [await generate(client, prompt_ids(rng, 32, vocab), max_tokens=2) for _ in range(4)]
    if run.victim:
        run.idle_s = await asyncio.to_thread(victim_idle, stack, run.victim, 30.0)
    res.counts = {**_drain_stream_counts(run), **_drain_router_counts(run.delta), **_drain_after_counts(run)}
    _check_drained_streams(res, run)
    _check_drain_bookkeeping(res, run)
    return res


@dataclass
class _DrainRun:
    """What decode_drain saw: each stream's outcome against its undisturbed reference."""

    max_tokens: int
    refs: list[tuple[int, ...]]  # the reference runs' output ids, per stream
    outs: list[dict]  # the streams through the drain (`_tracked`)
    drained: dict  # `_drain_when`'s record (worker, running, progress, snapshot); {} when none
    delta: dict[str, float]  # `drain_counters` after the streams minus before
    late: list[dict] = field(default_factory=list)  # requests sent after the drain mark
    idle_s: float | None = None  # when the drained replica held nothing any more

    @property
    def victim(self) -> str | None:
        return self.drained.get("worker")

    @property
    def identical(self) -> list[bool]:
        return [o["ok"] and o["result"].output_ids == r for o, r in zip(self.outs, self.refs, strict=True)]


async def _streams_through_drain(
    stack: FaultStack, client, prompts: list[list[int]], refs: list, max_tokens: int, drain_after_tokens: int
) -> _DrainRun:
    """The streams again; the busiest decode replica is drained once each got its tokens."""
    before = await drain_counters(stack)
    progress = [0] * len(prompts)
    drained: dict = {}
    outs = await asyncio.gather(
        *(_tracked(client, p, max_tokens, None, progress, i) for i, p in enumerate(prompts)),
        _drain_when(stack, progress, drain_after_tokens, drained),
    )
    after = await drain_counters(stack)
    delta = {k: after[k] - before[k] for k in after}
    return _DrainRun(max_tokens, refs, list(outs[: len(prompts)]), drained, delta)


def _drain_stream_counts(run: _DrainRun) -> dict:
    outs, victim = run.outs, run.victim
    return {
        "streams": len(outs),
        "drained": victim,
        "tokens_at_drain": run.drained.get("progress"),
        "paused_on_victim": run.drained.get("running"),
        "completed": sum(o["ok"] for o in outs),
        "failed": [o.get("code") for o in outs if not o["ok"]],
        "identical": sum(run.identical),
        "migrated_streams": sum(o["ok"] and o["result"].timeline["migrate_ms"] > 0 for o in outs),
        # streams with tokens still to come at the drain that nonetheless ended on the victim. The
        # snapshot is the client's count: up to DRAIN_IN_FLIGHT_TOKENS more may already be made
        # (one async step ahead, one in delivery) and cannot move, so those streams do not count
        "left_on_victim": sum(
            o["ok"] and o["result"].decode_worker == victim and got < run.max_tokens - DRAIN_IN_FLIGHT_TOKENS
            for o, got in zip(outs, run.drained.get("snapshot", []), strict=False)
        ),
    }


def _drain_router_counts(delta: dict[str, float]) -> dict:
    return {
        "migrated": delta["moved"],
        "stayed": delta["stayed"],
        "prefills": delta["prefills"],
        "retries": delta["retries"],
        "migrated_bytes": delta["bytes"],
    }


def _drain_after_counts(run: _DrainRun) -> dict:
    return {
        "late_requests_on_victim": sum(o["ok"] and o["result"].decode_worker == run.victim for o in run.late),
        "victim_idle_after_s": None if run.idle_s is None else round(run.idle_s, 2),
        "differing": [  # (stream, tokens matching, migrated)
            (
                i,
                _common_prefix(o["result"].output_ids, r) if o["ok"] else None,
                o["ok"] and o["result"].timeline["migrate_ms"] > 0,
            )
            for i, (o, r, same) in enumerate(zip(run.outs, run.refs, run.identical, strict=True))
            if not same
        ],
    }


def _check_drained_streams(res: ScenarioResult, run: _DrainRun) -> None:
    streams, identical = len(run.outs), run.identical
    res.check(run.victim is not None, "no decode replica was drained mid-stream")
    res.check(all(o["ok"] for o in run.outs), f"streams failed: {res.counts['failed']}")
    res.check(all(identical), f"{streams - sum(identical)} of {streams} streams differ")
    res.check(res.counts["left_on_victim"] == 0, "streams unfinished at the drain finished on the drained replica")


def _check_drain_bookkeeping(res: ScenarioResult, run: _DrainRun) -> None:
    """Migrations as the router counted them, requests after the mark, the replica left idle."""
    streams, delta = len(run.outs), run.delta
    res.check(
        res.counts["migrated_streams"] == delta["moved"],
        "streams reporting a migration != the router's migration count",
    )
    res.check(
        delta["moved"] >= 1 and delta["stayed"] == 0, f"migrations: {delta['moved']} moved, {delta['stayed']} stayed"
    )
    res.check(
        delta["prefills"] == streams and delta["retries"] == 0,
        f"{delta['prefills']} prefills for {streams} streams, {delta['retries']} retries",
    )
    res.check(
        all(o["ok"] for o in run.late) and res.counts["late_requests_on_victim"] == 0,
        "a request sent after the drain mark failed or landed on the drained replica",
    )
    res.check(run.idle_s is not None, "the drained replica still holds sequences or blocks")


async def _drain_when(stack: FaultStack, progress: list[int], after: int, out: dict) -> None:
    """Once every stream got `after` tokens, drain the busiest decode replica."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if all(p >= after for p in progress):
            busiest = max(
                (w for w in await asyncio.to_thread(stack.worker_stats) if w.role == "decode"), key=lambda w: w.running
            )
            out.update(
                worker=busiest.worker_id, running=busiest.running, progress=sorted(progress), snapshot=list(progress)
            )
            await stack.drain_replica(busiest.worker_id)
            return
        await asyncio.sleep(0.005)


def victim_idle(stack: FaultStack, worker_id: str, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started <= timeout_s:
        stats = [w for w in stack.worker_stats() if w.worker_id == worker_id]
        if not stats or (stats[0].running == 0 and stats[0].kv_blocks_used == 0):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


async def drain_counters(stack: FaultStack) -> dict[str, float]:
    moved = await router_counter(stack, "flashpd:stream_migrations_total")
    return {
        "moved": sum(v for k, v in moved.items() if 'outcome="moved"' in k),
        "stayed": sum(v for k, v in moved.items() if 'outcome="stayed"' in k),
        "bytes": sum((await router_counter(stack, "flashpd:stream_migration_bytes_total")).values()),
        "prefills": sum((await router_counter(stack, "flashpd:prefills_total")).values()),
        "retries": sum((await router_counter(stack, "flashpd:request_retries_total")).values()),
    }


# ------------------------------------------------------------------------------- Redis loss


async def redis_pause(stack: FaultStack, *, pause_s: float = 20.0, clients: int = 2, seed: int = 3) -> ScenarioResult:
    """Traffic while Redis is stopped (SIGSTOP) for `pause_s`: 0 failed requests."""
    res = ScenarioResult("redis_pause")
    health: Counter = Counter()
    stats = await _with_traffic(stack, clients, seed, _pause_fault(stack, pause_s, health))
    res.counts = {**stats, "health_during_pause": dict(health)}
    res.check(
        stats["failed"] == 0 and stats["ok"] > 0,
        f"{stats['failed']} of {stats['ok'] + stats['failed']} requests failed",
    )
    res.check(
        set(health) == {"grpc SERVING", "http 200"},
        f"health during the pause: {dict(health)} (workers were known: SERVING expected)",
    )
    return res


async def _pause_fault(stack: FaultStack, pause_s: float, health: Counter) -> None:
    """Pause Redis for `pause_s`, asking both health endpoints once a second meanwhile."""
    import httpx

    from flashpd_sdk import AsyncClient

    await asyncio.sleep(1.0)
    stack.redis_server.pause()
    try:
        async with (
            AsyncClient(stack.grpc_target) as client,
            httpx.AsyncClient(base_url=stack.http_url, timeout=10) as http,
        ):
            until = time.monotonic() + pause_s
            while time.monotonic() < until:
                with contextlib.suppress(Exception):
                    health[f"grpc {await client.health(timeout_s=5.0)}"] += 1
                with contextlib.suppress(Exception):
                    health[f"http {(await http.get('/health')).status_code}"] += 1
                await asyncio.sleep(max(0.0, min(1.0, until - time.monotonic())))
    finally:
        stack.redis_server.resume()
    await asyncio.sleep(2.0)


async def redis_restart(
    stack: FaultStack, *, down_s: float = 8.0, clients: int = 2, hits_within_s: float = 10.0, seed: int = 4
) -> ScenarioResult:
    """Redis killed (SIGKILL) for `down_s` under traffic, then restarted empty on its port:
    0 failed requests, workers re-registered and prefix hits back within `hits_within_s`."""
    from flashpd_sdk import AsyncClient

    res = ScenarioResult("redis_restart")
    vocab = await vocab_size(stack)
    # longer than exact replay's receptive field (1,271 tokens on tiny), so a hit earns credit
    # in either replay mode
    prefix = prompt_ids(random.Random(seed), 1800, vocab)
    # the worker that decodes holds the prefix: D's resident chunks, or a colocated worker's credit
    field = "cached_tokens" if stack.config.mode == "colocated" else "cached_tokens_decode"
    async with AsyncClient(stack.grpc_target) as client:
        await generate(client, prefix + [5, 6], max_tokens=2)  # cache the prefix somewhere
        res.counts["hits_before_s"] = await _hits_back(client, prefix, 60.0, field=field)  # the baseline

        async def fault() -> None:
            await asyncio.sleep(1.0)
            stack.redis_server.kill()
            await asyncio.sleep(down_s)
            stack.redis_server.restart()
            res.counts["hits_back_s"] = await _hits_back(client, prefix, 120.0, field=field)

        stats = await _with_traffic(stack, clients, seed, fault())
    registered = len(stack.worker_stats())
    res.counts.update(stats)
    res.counts["workers_registered_after"] = registered
    back = res.counts.get("hits_back_s")
    res.check(
        stats["failed"] == 0 and stats["ok"] > 0,
        f"{stats['failed']} of {stats['ok'] + stats['failed']} requests failed",
    )
    res.check(
        back is not None and back <= hits_within_s, f"prefix hits not back within {hits_within_s} s (took {back})"
    )
    want = sum(stack.config.worker_counts().values())
    res.check(registered == want, f"{registered} of {want} workers re-registered")
    return res


async def _hits_back(client, prefix: list[int], timeout_s: float, streak: int = 6, field: str = "cached_tokens_decode"):
    """Seconds from now until hits came back: the send time of the first of `streak` requests
    in a row (new ids, prompt = prefix + a new tail) placed on the decode worker holding the
    prefix (index-driven: blind placement finds it 1 time in 2, so 6 in a row by chance 1.6% of
    the time); None if no such streak within `timeout_s`."""
    started = time.monotonic()
    rng = random.Random(11)
    streak_began = None
    run = 0
    while time.monotonic() - started < timeout_s:
        sent = time.monotonic()
        out = await generate(client, prefix + prompt_ids(rng, 8, 200), max_tokens=1, timeout_s=60)
        hit = out["ok"] and getattr(out["result"].usage, field) >= len(prefix) // 2
        run = run + 1 if hit else 0
        if run == 1:
            streak_began = sent
        if run >= streak:
            return round(streak_began - started, 2)
    return None


async def _with_traffic(stack: FaultStack, clients: int, seed: int, fault) -> dict:
    """Back-to-back multi-turn session requests from `clients` loops while `fault` runs."""
    from flashpd_sdk import AsyncClient

    vocab = await vocab_size(stack)
    stats = {"ok": 0, "failed": 0, "codes": Counter(), "latencies": []}
    done = asyncio.Event()
    async with AsyncClient(stack.grpc_target) as client:

        async def loop(c: int) -> None:
            rng = random.Random(seed * 100 + c)
            context = prompt_ids(rng, 150, vocab)
            while not done.is_set():
                out = await generate(client, context, max_tokens=4, timeout_s=60, session_id=f"traffic-{seed}-{c}")
                if out["ok"]:
                    stats["ok"] += 1
                    stats["latencies"].append(out["e2e_s"])
                    context = context + list(out["result"].output_ids) + prompt_ids(rng, 20, vocab)
                    context = context[-1500:]
                else:
                    stats["failed"] += 1
                    stats["codes"][out["code"]] += 1

        loops = [asyncio.create_task(loop(c)) for c in range(clients)]
        try:
            await fault
        finally:
            done.set()
            await asyncio.gather(*loops)
    return {
        "ok": stats["ok"],
        "failed": stats["failed"],
        "codes": dict(stats["codes"]),
        "latency_s": percentiles(stats["latencies"]),
    }


# ------------------------------------------------------------------------------------- load


async def load(
    stack: FaultStack,
    *,
    n: int,
    prompt_tokens: int = 200,
    max_tokens: int = 16,
    channels: int = 8,
    seed: int = 5,
    idle_within_s: float = 30.0,
) -> ScenarioResult:
    """`n` streams at once (1 prefill + 1 decode): all complete (queued, not refused or hung),
    0 blocks held afterwards; TTFT percentiles."""
    res = ScenarioResult(f"load_{n}")
    vocab = await vocab_size(stack)
    prompts = [prompt_ids(random.Random(seed * 10_000 + i), prompt_tokens, vocab) for i in range(n)]
    outs, wall_s = await _all_at_once(stack, prompts, max_tokens, channels)
    ok = [o for o in outs if o["ok"]]
    codes = Counter(o["code"] for o in outs if not o["ok"])
    idle_s = await asyncio.to_thread(stack.wait_idle, idle_within_s)
    held = stack.blocks_held()
    res.counts["router_retries"] = await router_counter(stack, "flashpd:request_retries_total")
    res.counts.update(
        {
            "streams": n,
            "completed": len(ok),
            "failed": dict(codes),
            "wall_s": round(wall_s, 1),
            "ttft_s": percentiles([o["ttft_s"] for o in ok if o["ttft_s"] is not None]),
            "e2e_s": percentiles([o["e2e_s"] for o in ok]),
            "blocks_held_after": held,
            "idle_after_s": None if idle_s is None else round(idle_s, 2),
        }
    )
    res.check(len(ok) == n, f"{n - len(ok)} of {n} did not complete: {dict(codes)}")
    res.check(idle_s is not None and held == 0, f"{held} blocks held afterwards")
    return res


async def _all_at_once(
    stack: FaultStack, prompts: list[list[int]], max_tokens: int, channels: int
) -> tuple[list[dict], float]:
    """Every prompt sent at once, spread over `channels` SDK clients: the outcomes, and the
    wall time until the last one ended."""
    from flashpd_sdk import AsyncClient

    clients = [AsyncClient(stack.grpc_target) for _ in range(channels)]
    try:
        started = time.monotonic()
        outs = await asyncio.gather(
            *(generate(clients[i % channels], p, max_tokens=max_tokens, timeout_s=600) for i, p in enumerate(prompts))
        )
        return outs, time.monotonic() - started
    finally:
        for c in clients:
            await c.close()


async def router_counter(stack: FaultStack, name: str) -> dict[str, float]:
    """The router's Prometheus counter `name` by label set (cumulative since it started)."""
    import httpx

    out: dict[str, float] = {}
    with contextlib.suppress(Exception):
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=10) as http:
            text = (await http.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name):
                labels, _, value = line[len(name) :].rpartition(" ")
                out[labels or "{}"] = float(value)
    return out
