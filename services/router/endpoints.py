"""The seam between the orchestrator and the workers.

The orchestrator asks a `WorkerDirectory` for the endpoint of one worker incarnation and calls the
methods of `api.PrefillServerApi` / `api.DecodeServerApi` on it. Two kinds of endpoint fit:

- in-process objects with those async methods (unit tests, a single-process demo), through
  `StaticDirectory`;
- Ray Serve DeploymentHandles, through `ServeHandleWorker`: unary methods are
  `await handle.method.remote(...)`, `generate` goes through `handle.options(stream=True)` and is
  consumed with `async for`; cancelling the awaiting task cancels the request on the replica.
  A handle must reach the one worker the policy picked: `HandleDirectory(handle_for)` asks the
  deployment layer for it (e.g. one deployment per worker id, or a custom Serve request router
  that routes on the worker id).

Errors are left as raised; the orchestrator maps them with `api.as_service_error`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from flashpd.services.api import (
    DecodeServerApi,
    Event,
    InternalRequest,
    PrefillResult,
    PrefillServerApi,
    Ticket,
    Unavailable,
    WorkerRef,
    WorkerStats,
)


class WorkerDirectory(Protocol):
    def prefill(self, worker: WorkerRef) -> PrefillServerApi: ...

    def decode(self, worker: WorkerRef) -> DecodeServerApi: ...


class StaticDirectory:
    """Endpoints by worker id (any incarnation)."""

    def __init__(self, prefill: Mapping[str, PrefillServerApi],
                 decode: Mapping[str, DecodeServerApi]) -> None:
        self._prefill, self._decode = dict(prefill), dict(decode)

    def prefill(self, worker: WorkerRef) -> PrefillServerApi:
        return _lookup(self._prefill, worker)

    def decode(self, worker: WorkerRef) -> DecodeServerApi:
        return _lookup(self._decode, worker)


def _lookup(endpoints: Mapping[str, Any], worker: WorkerRef) -> Any:
    if worker.worker_id not in endpoints:
        raise Unavailable(f"no endpoint for worker {worker.key}")
    return endpoints[worker.worker_id]


class ServeHandleWorker:
    """A Ray Serve DeploymentHandle (reaching one worker) as a prefill and decode endpoint."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)

    async def reserve(self, req: InternalRequest) -> Ticket:
        return await self._handle.reserve.remote(req)

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        return await self._handle.run.remote(req, ticket)

    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        stream = self._streaming.generate.remote(req)
        finished = False
        try:
            async for event in stream:
                yield event
            finished = True
        finally:
            if not finished:  # consumer stopped early (stop string, cancel, deadline)
                stream.cancel()

    async def abort(self, request_id: str) -> bool:
        return await self._handle.abort.remote(request_id)

    async def stats(self) -> WorkerStats:
        return await self._handle.stats.remote()


class HandleDirectory:
    """Endpoints from `handle_for(worker) -> DeploymentHandle`, adapted once per incarnation."""

    def __init__(self, handle_for: Callable[[WorkerRef], Any]) -> None:
        self._handle_for = handle_for
        self._workers: dict[WorkerRef, ServeHandleWorker] = {}

    def prefill(self, worker: WorkerRef) -> PrefillServerApi:
        return self._get(worker)

    def decode(self, worker: WorkerRef) -> DecodeServerApi:
        return self._get(worker)

    def _get(self, worker: WorkerRef) -> ServeHandleWorker:
        if worker not in self._workers:
            self._workers[worker] = ServeHandleWorker(self._handle_for(worker))
        return self._workers[worker]
