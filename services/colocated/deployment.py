"""`ColocatedServer`: the colocated worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from flashpd.services.api import Event, InternalRequest
from flashpd.services.worker.deployment import WorkerDeployment


class ColocatedServer(WorkerDeployment):
    role = "colocated"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.colocated.server import ColocatedWorker

        return ColocatedWorker(engine, config, ref)

    async def generate(self, req: InternalRequest, target_worker: str | None = None) -> AsyncIterator[Event]:
        self._check_target(target_worker)
        events = self.worker.generate(req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def _drained_by_mark(self, marked: bool) -> None:
        """Marked draining in Redis: take nothing new, let the running streams finish here."""
        if marked:
            await self.worker.drain()
        else:
            self.worker.undrain()

    async def drain(self, deadline_s: float = 30.0, target_worker: str | None = None) -> int:
        """Mark this worker draining in Redis (no router places a new request here) and refuse
        new requests; the streams running here finish in place. Returns how many run."""
        self._check_target(target_worker)
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.mark_draining)
        return await self.worker.drain()
