"""ShareGPT-shaped serving benchmark over the OpenAI HTTP endpoint (beside the AgentX-like one).

    python -m flashpd.bench.sharegpt --target http://127.0.0.1:8000 --requests 64 --rate 1
    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.sharegpt --serve'   # local stack

As the common ShareGPT serving benchmarks do: each request is one real conversation's first user
turn (with any system text before it), sent as chat messages, and asks for exactly as many tokens
as that conversation's first assistant reply had (`ignore_eos`, greedy), capped at
`--max-output-tokens`; conversations whose prompt exceeds `--max-prompt-tokens` are skipped. The
sample is seeded. Requests arrive open-loop (Poisson at `--rate` per second, `inf` = all at once)
with at most `--max-concurrency` in flight, each streamed over `/v1/chat/completions` (SSE with
usage). Each request becomes a `RequestRecord` (TTFT, gaps between streamed chunks as ITL, e2e,
cached tokens from `prompt_tokens_details`); the run's metrics are `bench.metrics.aggregate`
over the whole run as the window; records and meta are written with `bench.records.write_run`,
and a report.md beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field

from flashpd.bench.metrics import RunMetrics, aggregate
from flashpd.bench.records import Phase, RequestRecord, RunMeta, write_run

DEFAULT_OUT = "bench/results/sharegpt"


# ============================================================================ requests
@dataclass(frozen=True)
class ShareGPTRequest:
    index: int
    conversation_id: str
    messages: tuple[dict, ...]
    prompt_tokens: int  # chat-templated prompt, by the served tokenizer
    output_tokens: int  # the conversation's first reply, capped


def sample_requests(
    tokenizer,
    n: int,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    max_output_tokens: int = 256,
    min_output_tokens: int = 4,
    conversations=None,
) -> list[ShareGPTRequest]:
    """n requests from ShareGPT conversations (seeded shuffle of the dataset's order)."""
    from flashpd.model import train_data
    from flashpd.services.router.convert import deepseek_chat_prompt

    convs = list(conversations) if conversations is not None else train_data.load_conversations()
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out: list[ShareGPTRequest] = []
    for i in order:
        pair = train_data.prompt_and_reply(convs[i])
        if pair is None:
            continue
        messages, reply = pair
        prompt = len(tokenizer.encode(deepseek_chat_prompt(messages), add_special_tokens=False).ids)
        output = len(tokenizer.encode(reply, add_special_tokens=False).ids)
        if prompt > max_prompt_tokens or output < min_output_tokens:
            continue
        out.append(ShareGPTRequest(len(out), convs[i].id, tuple(messages), prompt, min(output, max_output_tokens)))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"only {len(out)} conversations fit --max-prompt-tokens {max_prompt_tokens}; asked for {n}")
    return out


# ============================================================================ HTTP backend
@dataclass
class ChatResult:
    chunk_times: list[float] = field(default_factory=list)  # clock time of each content chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_prefill: int | None = None
    cached_tokens_decode: int | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    request_id: str | None = None
    finish_reason: str | None = None
    timeline: dict = field(default_factory=dict)


class SSEError(Exception):
    """The stream carried an error object or a malformed line."""


def parse_sse_line(line: str) -> dict | None:
    """`data: {...}` -> the object; `data: [DONE]` / blank / comment -> None."""
    line = line.strip()
    if not line or line.startswith(":") or not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as e:
        raise SSEError(f"malformed SSE payload: {payload[:80]!r}") from e
    if "error" in obj:
        raise SSEError(f"server error: {obj['error']}")
    return obj


def apply_chunk(result: ChatResult, obj: dict, now: float) -> None:
    """Fold one streamed chat chunk into the result."""
    for choice in obj.get("choices") or []:
        if (choice.get("delta") or {}).get("content"):
            result.chunk_times.append(now)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    ext = obj.get("flashpd")
    if ext:
        result.request_id = ext.get("request_id")
        result.prefill_worker, result.decode_worker = ext.get("prefill_worker"), ext.get("decode_worker")
        result.cached_tokens_prefill = ext.get("cached_tokens_prefill")
        result.cached_tokens_decode = ext.get("cached_tokens_decode")
        result.timeline = dict(ext.get("timeline") or {})
    usage = obj.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


class HttpChat:
    """Streams /v1/chat/completions with httpx (one shared async client)."""

    def __init__(self, target: str, model: str, timeout_s: float = 600.0, transport=None):
        import httpx

        self.url = target.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport)

    async def chat(self, req: ShareGPTRequest, clock: Callable[[], float]) -> ChatResult:
        body = {
            "model": self.model,
            "messages": list(req.messages),
            "max_tokens": req.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = ChatResult()
        async with self._client.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise SSEError(f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                obj = parse_sse_line(line)
                if obj is not None:
                    apply_chunk(result, obj, clock())
        return result

    async def aclose(self) -> None:
        await self._client.aclose()


# ============================================================================ the run
def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate`/s; all zero for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def to_record(
    req: ShareGPTRequest, start: float, end: float, result: ChatResult | None, error: BaseException | None
) -> RequestRecord:
    times = result.chunk_times if result else []
    return RequestRecord(
        lane=0,
        phase=Phase.MEASURE,
        tree_id=req.index,
        request_index=req.index,
        agent="sharegpt",
        session_id=f"sharegpt-{req.index}",
        parent_session_id=None,
        turn_index=0,
        think_s=0.0,
        start_s=start,
        end_s=end,
        ttft_s=(times[0] - start) if times else None,
        itl_s=[b - a for a, b in zip(times, times[1:], strict=False)],
        prompt_tokens=(result.prompt_tokens if result and result.prompt_tokens is not None else req.prompt_tokens),
        expected_output_tokens=req.output_tokens,
        output_tokens=(result.completion_tokens if result and result.completion_tokens is not None else len(times)),
        ideal_cached_tokens=0,
        cached_tokens=result.cached_tokens if result else None,
        cached_tokens_prefill=result.cached_tokens_prefill if result else None,
        cached_tokens_decode=result.cached_tokens_decode if result else None,
        prefill_worker=result.prefill_worker if result else None,
        decode_worker=result.decode_worker if result else None,
        request_id=result.request_id if result else None,
        finish_reason=result.finish_reason if result else None,
        error_type=type(error).__name__ if error else None,
        error=str(error)[:300] if error else None,
        timeline=result.timeline if result else {},
    )


async def run_benchmark(
    requests: Sequence[ShareGPTRequest],
    chat: Callable[[ShareGPTRequest], Awaitable[ChatResult]],
    offsets: Sequence[float],
    max_concurrency: int,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> tuple[list[RequestRecord], float, float]:
    """Send each request at its offset (at most max_concurrency in flight); (records, t0, t1).

    `clock` (seconds) and `sleep` are injected; a failed request is recorded with its error."""
    if len(offsets) != len(requests):
        raise ValueError("one arrival offset per request")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    gate = asyncio.Semaphore(max_concurrency)
    records: list[RequestRecord] = []
    t0 = clock()

    async def one(req: ShareGPTRequest, offset: float) -> None:
        delay = t0 + offset - clock()
        if delay > 0:
            await sleep(delay)
        async with gate:
            start = clock()
            result, error = None, None
            try:
                result = await chat(req)
            except Exception as exc:  # recorded; the run goes on
                error = exc
            records.append(to_record(req, start, clock(), result, error))

    await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    records.sort(key=lambda r: r.request_index)
    return records, t0, clock()


# ============================================================================ report
def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{1e3 * x:.0f}"


def render_report(meta: RunMeta, m: RunMetrics, records: Sequence[RequestRecord], command: str) -> str:
    ok = [r for r in records if r.ok]
    prompt = [r.prompt_tokens for r in ok]
    outs = [r.output_tokens for r in ok]
    w = meta.workload
    lines = [
        "# ShareGPT-shaped serving benchmark",
        "",
        f"Command: `{command}`",
        "",
        f"Target {meta.target} (model `{w.get('model')}`), {meta.started_at}. {len(records)} "
        f"requests from ShareGPT conversations (seed {w.get('seed')}; prompt = first user turn, "
        f"output = first reply's length, capped at {w.get('max_output_tokens')}), Poisson "
        f"arrivals at {w.get('rate')}/s, at most {meta.concurrency} in flight, greedy, "
        "ignore_eos, streamed over /v1/chat/completions."
        + (
            f" Host: {w['host']['cpus']} CPUs, 1-min load {w['host']['loadavg_1m_at_start']} at start."
            if w.get("host")
            else ""
        ),
        "",
        "| metric | value |",
        "|---|---|",
        f"| requests ok / errors | {len(ok)} / {m.errors} {m.errors_by_type or ''} |",
        f"| duration (s) | {m.window_s:.1f} |",
        f"| prompt tokens mean / max | {sum(prompt) / max(len(prompt), 1):.0f} / {max(prompt, default=0)} |",
        f"| output tokens mean / max | {sum(outs) / max(len(outs), 1):.0f} / {max(outs, default=0)} |",
        f"| request throughput (req/s) | {len(ok) / max(m.window_s, 1e-9):.3f} |",
        f"| output tokens/s | {m.output_tok_s_per_gpu * m.num_gpus:.1f} |",
        f"| total tokens/s (prompt + output) | {m.total_tok_s_per_gpu * m.num_gpus:.1f} |",
        f"| TTFT p50 / p90 / p99 (ms) | {_ms(m.ttft_s.p50)} / {_ms(m.ttft_s.p90)} / {_ms(m.ttft_s.p99)} |",
        f"| ITL p50 / p90 / p99 (ms) | {_ms(m.itl_s.p50)} / {_ms(m.itl_s.p90)} / {_ms(m.itl_s.p99)} |",
        f"| E2E p50 / p90 / p99 (ms) | {_ms(m.e2e_s.p50)} / {_ms(m.e2e_s.p90)} / {_ms(m.e2e_s.p99)} |",
        f"| prefix-cache hit rate (cached / prompt tokens) | {m.hit_rate_actual:.3f} |",
        "",
        "ShareGPT requests are single first turns of unrelated conversations, so prefix hits come "
        "only from shared chat-template tokens; the AgentX-like benchmark (bench/cli.py) is the "
        "one that exercises session reuse.",
        "",
    ]
    return "\n".join(lines)


async def _main_async(args, requests, command: str) -> tuple[RunMeta, list[RequestRecord]]:
    chat_backend = HttpChat(args.target, args.model, args.request_timeout_s)
    loop = asyncio.get_running_loop()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    host = {"cpus": os.cpu_count(), "loadavg_1m_at_start": round(os.getloadavg()[0], 1)}
    try:
        records, t0, t1 = await run_benchmark(
            requests,
            lambda r: chat_backend.chat(r, loop.time),
            arrival_times(len(requests), args.rate, args.seed),
            args.max_concurrency,
            loop.time,
        )
    finally:
        await chat_backend.aclose()
    meta = RunMeta(
        name="sharegpt",
        target=args.target,
        concurrency=args.max_concurrency,
        num_gpus=1,
        window_s=t1 - t0,
        window_start_s=t0,
        window_end_s=t1,
        started_at=started,
        workload={
            "kind": "sharegpt",
            "model": args.model,
            "seed": args.seed,
            "host": host,
            "requests": len(requests),
            "rate": args.rate,
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_output_tokens": args.max_output_tokens,
            "sample": [asdict(r) | {"messages": len(r.messages)} for r in requests],
        },
        driver={"command": command, "max_concurrency": args.max_concurrency},
    )
    return meta, records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="flashpd-small", help="served model id")
    ap.add_argument("--serve", action="store_true", help="start the local stack (flashpd serve defaults) for the run")
    ap.add_argument("--checkpoint", default=None, help="with --serve (default: small preset)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (inf = all at once)")
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-output-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    ckpt = args.checkpoint
    if ckpt is None:
        from flashpd.model.presets.small import checkpoint_path

        ckpt = checkpoint_path()
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    requests = sample_requests(tok, args.requests, args.seed, args.max_prompt_tokens, args.max_output_tokens)
    command = "python -m flashpd.bench.sharegpt " + " ".join(argv)
    if args.serve:
        from flashpd.services import cli as serve_cli
        from flashpd_sdk import Client

        parser = argparse.ArgumentParser(prog="flashpd")
        serve_cli.register(parser.add_subparsers(dest="command"))
        serve_argv = ["serve", "--http-port", args.target.rsplit(":", 1)[1]]
        stack = parser.parse_args(
            serve_argv + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
        )  # serve's defaults
        local_stack, wait_healthy = serve_cli.local_stack, serve_cli.wait_healthy
        with local_stack(stack) as a:
            client = Client(f"127.0.0.1:{stack.grpc_port}")
            wait_healthy(client)
            client.close()
            args.model = a["model_id"]
            meta, records = asyncio.run(_main_async(args, requests, command))
    else:
        meta, records = asyncio.run(_main_async(args, requests, command))
    metrics = aggregate(meta, records)
    write_run(args.out, meta, records)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(render_report(meta, metrics, records, command))
    print(render_report(meta, metrics, records, command))
    return 0 if metrics.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
