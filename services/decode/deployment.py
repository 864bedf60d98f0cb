"""`DecodeServer`: the decode worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from flashpd.services.api import Event, InternalRequest, Ticket
from flashpd.services.worker.deployment import WorkerDeployment


class DecodeServer(WorkerDeployment):
    role = "decode"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.decode.server import DecodeWorker

        return DecodeWorker(engine, config, ref)

    async def reserve(self, req: InternalRequest, target_worker: str | None = None) -> Ticket:
        self._check_target(target_worker)
        return await self.worker.reserve(req)

    async def generate(self, req: InternalRequest,
                       target_worker: str | None = None) -> AsyncIterator[Event]:
        self._check_target(target_worker)
        events = self.worker.generate(req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
