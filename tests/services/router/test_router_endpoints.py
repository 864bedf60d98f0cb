"""The Ray Serve seam, exercised with a stand-in that has DeploymentHandle's calling shape:
`handle.method.remote(...)` is awaited; `handle.options(stream=True).generate.remote(...)` is
async-iterated and has `cancel()`."""

import asyncio

import pytest
from router_fakes import FakeDecode, FakePrefill, collect, request, router_stack

from flashpd.services.api import WorkerRef
from flashpd.services.router.endpoints import HandleDirectory

pytestmark = pytest.mark.net
PROMPT = tuple(range(1, 300))


class FakeStreamResponse:
    def __init__(self, agen):
        self._agen, self.cancelled = agen, False

    def __aiter__(self):
        return self._agen

    def cancel(self):
        self.cancelled = True


class FakeMethod:
    def __init__(self, handle, name):
        self._handle, self._name = handle, name

    def remote(self, *args, **kwargs):
        self._handle.calls.append((self._name, kwargs))
        target = kwargs.pop("target_worker")
        assert target == self._handle.worker.worker_id
        result = getattr(self._handle.worker, self._name)(*args, **kwargs)
        if self._handle.stream:
            response = FakeStreamResponse(result)
            self._handle.streams.append(response)
            return response
        return result  # a coroutine: awaitable like a DeploymentResponse


class FakeHandle:
    def __init__(self, worker, stream=False, calls=None, streams=None):
        self.worker, self.stream = worker, stream
        self.calls = [] if calls is None else calls
        self.streams = [] if streams is None else streams

    def options(self, *, stream=False):
        return FakeHandle(self.worker, stream, self.calls, self.streams)

    def __getattr__(self, name):
        return FakeMethod(self, name)


def test_orchestrator_over_handle_shaped_endpoints(redis_url):
    p, d = FakePrefill("p0"), FakeDecode("d0")
    handles = {"p0": FakeHandle(p), "d0": FakeHandle(d)}
    directory = HandleDirectory(lambda w: handles[w.worker_id], lambda w: {"target_worker": w.worker_id})

    async def main():
        async with router_stack(redis_url, [p], [d]) as s:
            s.orchestrator.directory = directory
            events = await collect(s.orchestrator, s.orchestrator.open(request(PROMPT, max_tokens=10, stop=("cd",))))
        assert "".join(e.text for e in events) == "ab" and events[-1].finish_reason == "stop"
        assert [name for name, _ in handles["d0"].calls] == ["reserve", "generate", "abort"]
        assert [name for name, _ in handles["p0"].calls] == ["start", "run", "abort"]  # start: head start
        assert handles["d0"].streams[0].cancelled  # stopped early: the Serve stream is cancelled

    asyncio.run(main())


def test_handle_directory_adapts_each_incarnation_once():
    made = []
    directory = HandleDirectory(lambda w: made.append(w) or FakeHandle(FakeDecode(w.worker_id)))
    a, b = WorkerRef("decode", "d0", "i1"), WorkerRef("decode", "d0", "i2")
    assert directory.decode(a) is directory.decode(a)
    assert directory.decode(b) is not directory.decode(a)
    assert made == [a, b]
