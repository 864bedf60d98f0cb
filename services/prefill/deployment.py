"""`PrefillServer`: the prefill worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

from flashpd.services.api import InternalRequest, PrefillResult, Ticket
from flashpd.services.worker.deployment import WorkerDeployment


class PrefillServer(WorkerDeployment):
    role = "prefill"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.prefill.server import PrefillWorker

        return PrefillWorker(engine, config, ref)

    async def start(self, req: InternalRequest, target_worker: str | None = None) -> bool:
        self._check_target(target_worker)
        return await self.worker.start(req)

    async def run(self, req: InternalRequest, ticket: Ticket, target_worker: str | None = None) -> PrefillResult:
        self._check_target(target_worker)
        return await self.worker.run(req, ticket)

    async def kv_transports(self, target_worker: str | None = None) -> dict[str, str]:
        """Decode peer -> the transport UCX moved this worker's KV over, read back after the
        first push to it (NIXL backend; empty before the first push or with `local`)."""
        self._check_target(target_worker)
        reports = getattr(self.worker.sender, "transports", {})
        return {peer: report.transport for peer, report in reports.items()}

    async def push_records(self, target_worker: str | None = None) -> list[dict]:
        """The last KV pushes' timings (services/prefill/server.py `_record_push`)."""
        self._check_target(target_worker)
        return list(self.worker.push_records)
