"""ShareGPT-shaped serving benchmark: request sampling, SSE parsing, the open-loop run."""

from __future__ import annotations

import asyncio
import heapq
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from tokenizers import Tokenizer

from flashpd.bench import sharegpt as sg
from flashpd.bench.metrics import aggregate
from flashpd.bench.records import RunMeta
from flashpd.model.presets import tokenizer_path
from flashpd.model.train_data import Conversation
from flashpd.services.router.convert import deepseek_chat_prompt


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(tokenizer_path("small"))


def _conv(i: int, question: str, answer: str) -> Conversation:
    return Conversation(f"c{i}_0", (("user", question), ("assistant", answer)))


def test_requests_take_prompt_and_output_lengths_from_the_conversations(tok):
    convs = [_conv(i, f"Question {i}: " + "word " * (5 * i), "answer " * (3 + 4 * i)) for i in range(12)]
    reqs = sg.sample_requests(tok, 5, seed=3, max_prompt_tokens=40, max_output_tokens=20, conversations=convs)
    assert len(reqs) == 5 and [r.index for r in reqs] == list(range(5))
    by_id = {c.id: c for c in convs}
    for r in reqs:
        conv = by_id[r.conversation_id]
        prompt = deepseek_chat_prompt([{"role": "user", "content": conv.turns[0][1]}])
        assert r.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False).ids) <= 40
        reply = len(tok.encode(conv.turns[1][1], add_special_tokens=False).ids)
        assert r.output_tokens == min(reply, 20)
    again = sg.sample_requests(tok, 5, seed=3, max_prompt_tokens=40, max_output_tokens=20, conversations=convs)
    assert again == reqs
    other = sg.sample_requests(tok, 5, seed=4, max_prompt_tokens=40, max_output_tokens=20, conversations=convs)
    assert [r.conversation_id for r in other] != [r.conversation_id for r in reqs]
    with pytest.raises(ValueError, match="max-prompt-tokens"):
        sg.sample_requests(tok, 11, max_prompt_tokens=40, conversations=convs)


def test_sse_lines_fold_into_a_result():
    r = sg.ChatResult()
    assert sg.parse_sse_line("") is None and sg.parse_sse_line("data: [DONE]") is None
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"content": " there"}}]},
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "flashpd": {
                "request_id": "r1",
                "prefill_worker": "p",
                "decode_worker": "d",
                "cached_tokens_prefill": 0,
                "cached_tokens_decode": 128,
                "timeline": {"first_token_ms": 5.0},
            },
        },
        {
            "choices": [],
            "usage": {"prompt_tokens": 300, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 128}},
        },
    ]
    for t, c in enumerate(chunks):
        sg.apply_chunk(r, sg.parse_sse_line("data: " + json.dumps(c)), float(t))
    assert r.chunk_times == [0.0, 1.0] and r.finish_reason == "length"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (300, 2, 128)
    assert r.decode_worker == "d" and r.timeline == {"first_token_ms": 5.0}
    with pytest.raises(sg.SSEError, match="server error"):
        sg.parse_sse_line('data: {"error": {"message": "boom"}}')
    with pytest.raises(sg.SSEError, match="malformed"):
        sg.parse_sse_line("data: {not json")


class VirtualClock:
    """Virtual time: sleepers wake in time order; time jumps when every task is waiting."""

    def __init__(self):
        self.t, self._seq, self._waiters = 100.0, 0, []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, dt: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiters, (self.t + max(dt, 0.0), self._seq, fut))
        await fut

    async def run(self, coro):
        task = asyncio.ensure_future(coro)
        while not task.done():
            for _ in range(20):  # let every runnable task reach its next wait
                await asyncio.sleep(0)
            if self._waiters and not task.done():
                wake, _, fut = heapq.heappop(self._waiters)
                self.t = max(self.t, wake)
                fut.set_result(None)
        return task.result()


def _reqs(n: int) -> list[sg.ShareGPTRequest]:
    return [sg.ShareGPTRequest(i, f"c{i}", ({"role": "user", "content": "q"},), 10 + i, 3) for i in range(n)]


def test_run_records_ttft_itl_and_errors_on_the_injected_clock():
    clock = VirtualClock()
    in_flight, peak = 0, 0

    async def chat(req):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            if req.index == 2:
                raise sg.SSEError("HTTP 503: overloaded")
            res = sg.ChatResult()
            await clock.sleep(0.5)  # time to first token
            for _ in range(req.output_tokens):
                res.chunk_times.append(clock())
                await clock.sleep(0.1)
            res.prompt_tokens, res.completion_tokens, res.cached_tokens = req.prompt_tokens, req.output_tokens, 0
            return res
        finally:
            in_flight -= 1

    offsets = [0.0, 0.0, 1.0, 5.0]
    records, t0, t1 = asyncio.run(clock.run(sg.run_benchmark(_reqs(4), chat, offsets, 2, clock, clock.sleep)))
    assert peak == 2 and t0 == 100.0 and t1 == pytest.approx(105.8)
    assert [r.start_s for r in records] == pytest.approx([100.0, 100.0, 101.0, 105.0])
    ok = [r for r in records if r.ok]
    assert len(ok) == 3 and records[2].error_type == "SSEError"
    for r in ok:
        assert r.ttft_s == pytest.approx(0.5)
        assert r.itl_s == pytest.approx([0.1, 0.1])
        assert r.e2e_s == pytest.approx(0.8)
        assert r.output_tokens == 3
    meta = RunMeta(
        name="sharegpt", target="fake", concurrency=2, num_gpus=1, window_s=t1 - t0, window_start_s=t0, window_end_s=t1
    )
    m = aggregate(meta, records)
    assert m.requests == 4 and m.errors == 1 and m.ttft_s.p50 == pytest.approx(0.5)
    text = sg.render_report(meta, m, records, "cmd")
    assert "TTFT p50" in text and "3 / 1" in text


def test_poisson_arrivals():
    assert sg.arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    times = sg.arrival_times(2000, 4.0, 1)
    assert times == sg.arrival_times(2000, 4.0, 1) and times == sorted(times)
    assert 2000 / times[-1] == pytest.approx(4.0, rel=0.1)
    with pytest.raises(ValueError):
        sg.arrival_times(3, 0.0, 0)


def test_http_chat_streams_through_an_openai_shaped_app():
    app = FastAPI()
    seen = {}

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.update(body)

        def events():
            for word in ("a", "b", "c"):
                yield "data: " + json.dumps({"choices": [{"delta": {"content": word}}]}) + "\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def main():
        chat = sg.HttpChat("http://test", "flashpd-small", transport=httpx.ASGITransport(app))
        try:
            ticks = iter(range(100))
            return await chat.chat(_reqs(1)[0], lambda: float(next(ticks)))
        finally:
            await chat.aclose()

    res = asyncio.run(main())
    assert len(res.chunk_times) == 3 and res.completion_tokens == 3
    assert seen["stream"] and seen["ignore_eos"] and seen["max_tokens"] == 3
    assert seen["stream_options"] == {"include_usage": True} and seen["temperature"] == 0.0
