"""`DecodeServer`: the decode worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

from flashpd.services.api import InternalRequest, MigrationResult, Ticket
from flashpd.services.worker.deployment import StreamingDeployment


class DecodeServer(StreamingDeployment):
    role = "decode"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.decode.server import DecodeWorker

        return DecodeWorker(engine, config, ref)

    async def reserve(self, req: InternalRequest, target_worker: str | None = None) -> Ticket:
        self._check_target(target_worker)
        return await self.worker.reserve(req)

    async def _drain_worker(self, deadline_s: float) -> int:
        """Live migration of every stream (see DecodeWorker.drain)."""
        return await self.worker.drain(deadline_s)

    async def migrate_out(self, request_id: str, ticket: Ticket, target_worker: str | None = None) -> MigrationResult:
        self._check_target(target_worker)
        return await self.worker.migrate_out(request_id, ticket)

    async def resume(self, request_id: str, target_worker: str | None = None) -> bool:
        self._check_target(target_worker)
        return await self.worker.resume(request_id)
