"""The seam between the orchestrator and the workers.

The orchestrator asks a `WorkerDirectory` for the endpoint of one worker incarnation and calls the
methods of `api.PrefillServerApi` / `api.DecodeServerApi` on it. Two kinds of endpoint fit:

- in-process objects with those async methods (unit tests, a single-process demo), through
  `StaticDirectory`;
- Ray Serve DeploymentHandles, through `ServeHandleWorker`: unary methods are
  `await handle.method.remote(...)`, `generate` goes through `handle.options(stream=True)` and is
  consumed with `async for`; cancelling the awaiting task cancels the request on the replica.
  A call must reach the one worker the policy picked: `HandleDirectory(handle_for,
  call_kwargs_for)` gets the handle from the deployment layer and can tag every call with the
  worker id for a custom Serve request router that routes on it (or use one deployment per
  worker).

Errors are left as raised; the orchestrator maps them with `api.as_service_error`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from flashpd.services.api import (
    ColocatedServerApi,
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

    def colocated(self, worker: WorkerRef) -> ColocatedServerApi: ...


class StaticDirectory:
    """Endpoints by worker id (any incarnation)."""

    def __init__(
        self,
        prefill: Mapping[str, PrefillServerApi],
        decode: Mapping[str, DecodeServerApi],
        colocated: Mapping[str, ColocatedServerApi] | None = None,
    ) -> None:
        self._prefill, self._decode, self._colocated = dict(prefill), dict(decode), dict(colocated or {})

    def prefill(self, worker: WorkerRef) -> PrefillServerApi:
        return _lookup(self._prefill, worker)

    def decode(self, worker: WorkerRef) -> DecodeServerApi:
        return _lookup(self._decode, worker)

    def colocated(self, worker: WorkerRef) -> ColocatedServerApi:
        return _lookup(self._colocated, worker)


def _lookup(endpoints: Mapping[str, Any], worker: WorkerRef) -> Any:
    if worker.worker_id not in endpoints:
        raise Unavailable(f"no endpoint for worker {worker.key}")
    return endpoints[worker.worker_id]


class ServeHandleWorker:
    """A Ray Serve DeploymentHandle as a prefill and decode endpoint. `call_kwargs` are added
    to every call (e.g. the worker id a pinning Serve request router routes on)."""

    def __init__(self, handle: Any, *, call_kwargs: Mapping[str, Any] | None = None) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self._kw = dict(call_kwargs or {})

    async def reserve(self, req: InternalRequest) -> Ticket:
        return await self._handle.reserve.remote(req, **self._kw)

    async def start(self, req: InternalRequest) -> bool:
        return await self._handle.start.remote(req, **self._kw)

    async def run(self, req: InternalRequest, ticket: Ticket) -> PrefillResult:
        return await self._handle.run.remote(req, ticket, **self._kw)

    async def generate(self, req: InternalRequest) -> AsyncIterator[Event]:
        stream = self._streaming.generate.remote(req, **self._kw)
        finished = False
        try:
            async for event in stream:
                yield event
            finished = True
        finally:
            if not finished:  # consumer stopped early (stop string, cancel, deadline)
                stream.cancel()

    async def abort(self, request_id: str) -> bool:
        return await self._handle.abort.remote(request_id, **self._kw)

    async def stats(self) -> WorkerStats:
        return await self._handle.stats.remote(**self._kw)


class HandleDirectory:
    """Endpoints from `handle_for(worker) -> DeploymentHandle`, adapted once per incarnation;
    `call_kwargs_for(worker)` adds per-worker call kwargs (default: none)."""

    def __init__(
        self,
        handle_for: Callable[[WorkerRef], Any],
        call_kwargs_for: Callable[[WorkerRef], Mapping[str, Any]] | None = None,
    ) -> None:
        self._handle_for = handle_for
        self._call_kwargs_for = call_kwargs_for or (lambda worker: {})
        self._workers: dict[WorkerRef, ServeHandleWorker] = {}

    def prefill(self, worker: WorkerRef) -> PrefillServerApi:
        return self._get(worker)

    def decode(self, worker: WorkerRef) -> DecodeServerApi:
        return self._get(worker)

    def colocated(self, worker: WorkerRef) -> ColocatedServerApi:
        return self._get(worker)

    def _get(self, worker: WorkerRef) -> ServeHandleWorker:
        if worker not in self._workers:
            self._workers[worker] = ServeHandleWorker(
                self._handle_for(worker), call_kwargs=self._call_kwargs_for(worker)
            )
        return self._workers[worker]
