"""AgentX-like agent loop over the OpenAI API: each session asks, the model calls a (fake) tool,
the driver runs the tool and sends its result back, for a number of turns.

    python -m flashpd.bench.agent_loop --target http://127.0.0.1:8000 [--sessions 4] [--turns 4]
    unshare -n sh -c 'ip link set lo up && python -m flashpd.bench.agent_loop --serve'

Every turn but the last sends the tools with `tool_choice: "required"` (the grammar makes even a
small model call a tool), the last with `auto`; the driver executes each call with
`fake_tool` (a deterministic function of the arguments, as a real tool would answer) and
appends the assistant turn and one `tool` message per call, so each prompt extends the last
and the server's prefix cache and session affinity carry the conversation. Per turn it records
latency, prompt / cached tokens and whether every call's arguments validate against the tool's
schema; the summary prints the totals. The session id travels in `x-session-id`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_files",
            "description": "Search the workspace",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 24},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["query", "limit"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = "You are an agent. Use the tools to answer; call several when useful."


def fake_tool(name: str, arguments: dict) -> str:
    """A deterministic stand-in for the tool (the loop's shape, not the tool, is measured)."""
    if name == "get_weather":
        return json.dumps(
            {
                "city": arguments.get("city"),
                "forecast": [{"day": d + 1, "temp_c": 12 + 3 * d} for d in range(int(arguments.get("days", 1)))],
            }
        )
    return json.dumps(
        {"matches": [f"src/{arguments.get('query', 'x')}_{i}.py" for i in range(int(arguments.get("limit", 1)))]}
    )


@dataclass
class TurnRecord:
    session: int
    turn: int
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    calls: int
    valid_calls: int


@dataclass
class LoopResult:
    turns: list[TurnRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def run_session(
    client, model: str, session: int, turns: int, max_tokens: int, seed: int, result: LoopResult
) -> None:
    import jsonschema

    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {session}: plan a trip and find the notes."},
    ]
    headers = {"x-session-id": f"agent-{seed}-{session}"}
    for turn in range(turns):
        last = turn == turns - 1
        t0 = time.perf_counter()
        out = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            tool_choice="auto" if last else "required",
            temperature=1.0,
            seed=seed * 1000 + session * 10 + turn,
            extra_headers=headers,
        )
        choice, usage = out.choices[0], out.usage
        calls = choice.message.tool_calls or []
        valid = 0
        for call in calls:
            try:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                valid += 1
            except (ValueError, KeyError, jsonschema.ValidationError) as exc:
                result.errors.append(f"session {session} turn {turn}: {exc}"[:200])
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        result.turns.append(
            TurnRecord(
                session,
                turn,
                time.perf_counter() - t0,
                usage.prompt_tokens,
                cached or 0,
                usage.completion_tokens,
                choice.finish_reason,
                len(calls),
                valid,
            )
        )
        if not calls:
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            break
        messages.append(
            {"role": "assistant", "content": choice.message.content, "tool_calls": [c.model_dump() for c in calls]}
        )
        for call in calls:  # the fake tool runs between turns
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": fake_tool(call.function.name, json.loads(call.function.arguments)),
                }
            )


async def run_loop(base_url: str, model: str, sessions: int, turns: int, max_tokens: int, seed: int) -> LoopResult:
    import openai

    result = LoopResult()
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        outcomes = await asyncio.gather(
            *(run_session(client, model, s, turns, max_tokens, seed, result) for s in range(sessions)),
            return_exceptions=True,
        )
    result.errors += [f"{type(o).__name__}: {o}"[:300] for o in outcomes if o is not None]
    return result


def summary(result: LoopResult, command: str) -> str:
    t = result.turns
    calls, valid = sum(r.calls for r in t), sum(r.valid_calls for r in t)
    later = [r for r in t if r.turn > 0]
    lines = [
        "# Agent loop (tools + fake tool between turns)",
        "",
        f"`{command}`",
        "",
        f"- turns: {len(t)} in {len({r.session for r in t})} sessions; errors: {len(result.errors)}",
        f"- tool calls: {calls}, arguments valid against the schema: {valid}",
        f"- finish reasons: {sorted({r.finish_reason for r in t})}",
        f"- latency per turn: median {statistics.median([r.latency_s for r in t]):.2f} s" if t else "- no turns",
        f"- turns after the first: cached / prompt tokens = "
        f"{sum(r.cached_tokens for r in later)} / {sum(r.prompt_tokens for r in later)}",
    ]
    lines += [f"  - {e}" for e in result.errors[:10]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="", help="served model id (default: the server's)")
    ap.add_argument("--serve", action="store_true", help="start the local stack for the run")
    ap.add_argument("--checkpoint", default=None, help="with --serve (default: small preset)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    command = "python -m flashpd.bench.agent_loop " + " ".join(argv)

    def go() -> LoopResult:
        return asyncio.run(run_loop(args.target, args.model, args.sessions, args.turns, args.max_tokens, args.seed))

    if args.serve:
        from flashpd.services import cli as serve_cli
        from flashpd_sdk import Client

        parser = argparse.ArgumentParser(prog="flashpd")
        serve_cli.register(parser.add_subparsers(dest="command"))
        stack = parser.parse_args(
            ["serve", "--http-port", args.target.rsplit(":", 1)[1]]
            + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
        )
        with serve_cli.local_stack(stack) as a:
            client = Client(f"127.0.0.1:{stack.grpc_port}")
            serve_cli.wait_healthy(client)
            client.close()
            args.model = args.model or a["model_id"]
            result = go()
    else:
        result = go()
    text = summary(result, command)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if not result.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
