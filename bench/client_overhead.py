"""Where an HTTP client's TTFT goes before the request reaches the router (issue 25's HTTP gap).

On the H200 stack an 8K-token prompt sent as token ids had a TTFT of 589 ms through the official
`openai` client and 472 ms through the SDK (gRPC), for the same server work. This measures the
client side with no server at all (httpx's MockTransport answers at once): the time from
`completions.create(...)` to its first streamed chunk, for the official client, for a raw httpx
POST of the same body, and the router's own parse + validation of that body.

    python -m flashpd.bench.client_overhead [--tokens 1024 8192 32768] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from flashpd.bench.records import write_markdown

SSE = (
    b'data: {"id":"x","object":"text_completion","created":0,"model":"m",'
    b'"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\ndata: [DONE]\n\n'
)


def _answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE)


def _mock_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(_answer), base_url="http://127.0.0.1:1")


async def _openai_ms(prompt, reps: int) -> list[float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="x", http_client=_mock_client())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=4, stream=True)
        async for _chunk in stream:
            break
        times.append((time.perf_counter() - t0) * 1e3)
    return times


async def _raw_ms(prompt, reps: int) -> list[float]:
    client, times = _mock_client(), []
    for _ in range(reps):
        t0 = time.perf_counter()
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}).encode()
        async with client.stream("POST", "/v1/completions", content=body) as resp:
            async for _line in resp.aiter_lines():
                break
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _router_parse_ms(prompt, reps: int) -> list[float]:
    from flashpd.services.router.validation import parse_json_body, token_ids

    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}).encode()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        body = parse_json_body(raw)
        if isinstance(body["prompt"], list):
            token_ids(body["prompt"], "prompt", 129_280)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(tokens: list[int], reps: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for n in tokens:
        ids = [rng.randrange(100, 120_000) for _ in range(n)]
        text = " ".join("word" for _ in range(n))  # about one token per word
        for kind, prompt in (("token ids", ids), ("text", text)):
            row = {"tokens": n, "prompt": kind}
            try:
                row["openai_ms"] = statistics.median(asyncio.run(_openai_ms(prompt, reps)))
            except ImportError:
                row["openai_ms"] = None
            row["raw_httpx_ms"] = statistics.median(asyncio.run(_raw_ms(prompt, reps)))
            row["router_parse_ms"] = statistics.median(_router_parse_ms(prompt, reps))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashpd.bench.client_overhead")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write a markdown table here")
    args = ap.parse_args(argv)
    rows = measure(args.tokens, args.reps)
    if args.out:
        write_markdown(args.out, _report(rows, args))
    return 0


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _report(rows: list[dict], args) -> list[str]:
    lines = [
        "# Client-side cost of a streamed completion (issue 25's HTTP TTFT gap)",
        "",
        "No server: httpx's MockTransport answers at once, so every millisecond here is the client's",
        "(building and sending the request, reading the first SSE chunk) or the router's own parse",
        "and validation of the same body. Median of the runs, ms.",
        "",
        "| prompt tokens | prompt as | official openai client | raw httpx POST | router parse + validate |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['prompt']} | {_cell(r['openai_ms'])} | {_cell(r['raw_httpx_ms'])} "
            f"| {_cell(r['router_parse_ms'])} |"
        )
    lines += [
        "",
        f"Command: `python -m flashpd.bench.client_overhead --tokens {' '.join(map(str, args.tokens))}"
        f" --reps {args.reps} --out {args.out}`",
    ]
    return lines

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
