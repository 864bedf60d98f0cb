"""`DecodeServer`: the decode worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from flashpd.services.api import Event, InternalRequest, MigrationResult, Ticket
from flashpd.services.worker.deployment import DRAIN_DEADLINE_S, WorkerDeployment


class DecodeServer(WorkerDeployment):
    role = "decode"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.decode.server import DecodeWorker

        return DecodeWorker(engine, config, ref)

    async def reserve(self, req: InternalRequest, target_worker: str | None = None) -> Ticket:
        self._check_target(target_worker)
        return await self.worker.reserve(req)

    async def generate(self, req: InternalRequest, target_worker: str | None = None) -> AsyncIterator[Event]:
        self._check_target(target_worker)
        events = self.worker.generate(req)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def _drained_by_mark(self, marked: bool) -> None:
        if marked:
            await self.worker.drain(DRAIN_DEADLINE_S)
        else:
            self.worker.undrain()

    async def drain(self, deadline_s: float = 30.0, target_worker: str | None = None) -> int:
        """Live migration of every stream (see DecodeWorker.drain); marks this worker
        draining in Redis first, so no router places a new request here."""
        self._check_target(target_worker)
        if self._publisher is not None:
            await asyncio.to_thread(self._publisher.mark_draining)
        return await self.worker.drain(deadline_s)

    async def migrate_out(self, request_id: str, ticket: Ticket, target_worker: str | None = None) -> MigrationResult:
        self._check_target(target_worker)
        return await self.worker.migrate_out(request_id, ticket)

    async def resume(self, request_id: str, target_worker: str | None = None) -> bool:
        self._check_target(target_worker)
        return await self.worker.resume(request_id)
