"""The flashpd_sdk adapter maps the SDK's stream, result and errors onto the Backend seam."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from flashpd.bench.backend import BackendError, GenerateCall, SdkBackend


class SdkError(Exception):
    pass


class Unavailable(SdkError):
    pass


class FakeStream:
    def __init__(self, chunks, result, error=None):
        self._chunks, self.result_value, self._error = chunks, result, error
        self.closed = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for chunk in self._chunks:
            yield chunk
        if self._error is not None:
            raise self._error

    @property
    def result(self):
        return self.result_value

    async def aclose(self):
        self.closed = True


class FakeClient:
    def __init__(self, stream):
        self.stream = stream
        self.kwargs = None
        self.closed = False

    def generate(self, **kwargs):
        self.kwargs = kwargs
        return self.stream

    async def close(self):
        self.closed = True


def sdk_result():
    usage = SimpleNamespace(  # the SDK's Usage fields (no speculation: zeros, as the wire sends them)
        prompt_tokens=5,
        completion_tokens=3,
        cached_tokens=4,
        cached_tokens_prefill=3,
        cached_tokens_decode=1,
        draft_tokens=0,
        accepted_draft_tokens=0,
        draft_steps=0,
        forced_acceptance_length=0.0,
    )
    return SimpleNamespace(
        request_id="r1",
        output_ids=[7, 8, 9],
        text="",
        finish_reason="length",
        usage=usage,
        timeline={"route": 0.001},
        prefill_worker="p1",
        decode_worker="d2",
    )


CALL = GenerateCall(prompt_ids=[1, 2, 3, 4, 5], max_tokens=3, session_id="s", parent_session_id="p", timeout_s=30.0)


def test_adapter_sends_greedy_ignore_eos_with_session_ids_and_maps_the_result():
    chunks = [SimpleNamespace(token_ids=[7], text="", index=0), SimpleNamespace(token_ids=[8, 9], text="", index=1)]
    client = FakeClient(FakeStream(chunks, sdk_result()))
    seen: list[list[int]] = []

    async def scenario():
        backend = SdkBackend(client, SdkError)
        done = await backend.generate(CALL, lambda ids: seen.append(list(ids)))
        await backend.aclose()
        return done

    done = asyncio.run(scenario())
    assert client.kwargs == dict(
        prompt_ids=[1, 2, 3, 4, 5],
        max_tokens=3,
        ignore_eos=True,
        session_id="s",
        parent_session_id="p",
        temperature=0.0,
        timeout_s=30.0,
    )
    assert seen == [[7], [8, 9]]
    assert (done.cached_tokens, done.cached_tokens_prefill, done.cached_tokens_decode) == (4, 3, 1)
    assert (done.prefill_worker, done.decode_worker, done.request_id) == ("p1", "d2", "r1")
    assert client.closed


def test_adapter_turns_sdk_errors_into_backend_errors():
    client = FakeClient(FakeStream([], None, error=Unavailable("no decode worker")))
    with pytest.raises(BackendError) as info:
        asyncio.run(SdkBackend(client, SdkError).generate(CALL, lambda ids: None))
    assert info.value.kind == "Unavailable" and "no decode worker" in info.value.message


def test_adapter_lets_other_exceptions_through():
    client = FakeClient(FakeStream([], None, error=KeyError("bug")))
    with pytest.raises(KeyError):
        asyncio.run(SdkBackend(client, SdkError).generate(CALL, lambda ids: None))


class EndlessStream(FakeStream):
    async def _iterate(self):
        while True:
            await asyncio.sleep(0.01)
            yield SimpleNamespace(token_ids=(1,), text="", index=0)


def test_adapter_closes_the_stream_when_the_request_is_cancelled():
    stream = EndlessStream([], None)

    async def scenario():
        task = asyncio.create_task(SdkBackend(FakeClient(stream), SdkError).generate(CALL, lambda ids: None))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert stream.closed


@pytest.mark.net
def test_adapter_matches_the_real_sdk_and_maps_unavailable():
    # loopback port 1 refuses connections: the real AsyncClient accepts our keyword arguments,
    # retries, then raises Unavailable, which must surface as a BackendError
    pytest.importorskip("flashpd_sdk")

    async def scenario():
        backend = SdkBackend.connect("127.0.0.1:1")
        try:
            await backend.generate(CALL, lambda ids: None)
        finally:
            await backend.aclose()

    with pytest.raises(BackendError) as info:
        asyncio.run(scenario())
    assert info.value.kind == "Unavailable"
