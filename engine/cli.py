"""`flashpd generate`: one prompt, or a JSONL file of requests run concurrently through one engine.

Each JSONL line: {"id", "prompt" | "prompt_ids", "max_tokens", "temperature"?, "seed"?,
"session_id"?, "stop"?, "ignore_eos"?}. Output: one JSON line per request with id, output_ids,
text, prompt_tokens, cached_tokens, ttft_ms, finish_reason. `--sequential` finishes each request
before adding the next, so later requests that share a prefix hit the earlier ones' chunks.
"""

from __future__ import annotations

import json
import sys

from flashpd.engine.detokenizer import TextStream
from flashpd.engine.llm_engine import EngineConfig, LLMEngine
from flashpd.engine.loading import load_engine, load_tokenizer
from flashpd.engine.sampling import SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate from a checkpoint with the local engine")
    p.add_argument("--checkpoint", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--requests", help="JSONL file, one request per line")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--sequential", action="store_true")
    p.add_argument(
        "--no-swa-bounded-replay", action="store_true", help="exact replay after prefix hits (outputs equal a cold run)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument("--device", default="cpu", help="cpu (reference forward) or cuda[:N] (Triton kernels, CUDA graphs)")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument(
        "--speculative",
        choices=["dspark", "ngram"],
        default=None,
        help="speculative decoding with this drafter (engine/speculative.py)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.set_defaults(func=run)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise SystemExit(f"--prompt-ids: expected comma-separated integers ({exc})") from None


def _requests_from_args(args, tokenizer) -> list[dict]:
    if args.requests:
        with open(args.requests) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    else:
        line = {"id": "0", "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
        if args.prompt is not None:
            line["prompt"] = args.prompt
        else:
            line["prompt_ids"] = _parse_ids(args.prompt_ids)
        lines = [line]
    for i, line in enumerate(lines):
        if "prompt_ids" not in line:
            if "prompt" not in line or tokenizer is None:
                raise SystemExit(f"request {i}: needs prompt_ids (or prompt with a tokenizer)")
            line["prompt_ids"] = tokenizer.encode(line["prompt"]).ids
        line.setdefault("id", str(i))
    return lines


def _params(line: dict) -> SamplingParams:
    keys = (
        "max_tokens",
        "temperature",
        "seed",
        "top_k",
        "top_p",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
    )
    return SamplingParams.from_dict({k: line[k] for k in keys if line.get(k) is not None})


def run_requests(engine: LLMEngine, lines: list[dict], sequential: bool, tokenizer=None) -> list[dict]:
    """Text and stop strings as the router applies them: each request's tokens go through a
    TextStream, and a matched stop string aborts the request (finish_reason "stop")."""
    results: dict[str, dict] = {}
    streams: dict[str, TextStream] = {}
    pending = list(lines)

    def admit(line):
        rid = str(line["id"])
        params = _params(line)
        engine.add_request(rid, line["prompt_ids"], params, line.get("session_id"))
        results[rid] = {"id": rid, "output_ids": [], "text": "", "prompt_ids": line["prompt_ids"]}
        if tokenizer is not None:
            streams[rid] = TextStream(tokenizer, params.stop)

    if not sequential:
        for line in pending:
            admit(line)
        pending = []
    while pending or engine.has_unfinished():
        if sequential and not engine.has_unfinished():
            admit(pending.pop(0))
        for out in engine.step():
            r = results[out.request_id]
            r["output_ids"].extend(out.new_token_ids)
            finish_reason = out.finish_reason if out.finished else None
            stream = streams.get(out.request_id)
            for t in out.new_token_ids if stream is not None else ():
                r["text"] += stream.push(t)
                if stream.stopped:
                    engine.abort(out.request_id)
                    finish_reason = "stop"
                    break
            if stream is not None and out.finished and not stream.stopped:
                r["text"] += stream.flush()
            if finish_reason is not None:
                st = engine.stats[out.request_id]
                r.update(
                    prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens,
                    ttft_ms=st.ttft_ms,
                    finish_reason=finish_reason,
                )
    return [results[str(line["id"])] for line in lines]


def run(args) -> int:
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    spec = None if args.speculative is None else {"method": args.speculative, "num_tokens": args.num_speculative_tokens}
    config = EngineConfig(
        swa_bounded_replay=not args.no_swa_bounded_replay,
        dtype=dtype,
        device=args.device,
        num_blocks=args.num_blocks,
        speculative=spec,
    )
    engine = load_engine(args.checkpoint, config)
    tokenizer = load_tokenizer(args.checkpoint)
    lines = _requests_from_args(args, tokenizer)
    for r in run_requests(engine, lines, args.sequential, tokenizer):
        if args.json or args.requests:
            print(
                json.dumps(
                    r
                    if args.requests
                    else {"prompt_ids": r["prompt_ids"], "output_ids": r["output_ids"], "text": r["text"]}
                )
            )
        else:
            print(r["text"])
    sys.stdout.flush()
    return 0
