"""`PrefillServer`: the prefill worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

from flashpd.services.api import InternalRequest, PrefillResult, Ticket
from flashpd.services.worker.deployment import WorkerDeployment


class PrefillServer(WorkerDeployment):
    role = "prefill"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.prefill.server import PrefillWorker

        return PrefillWorker(engine, config, ref)

    async def run(self, req: InternalRequest, ticket: Ticket,
                  target_worker: str | None = None) -> PrefillResult:
        self._check_target(target_worker)
        return await self.worker.run(req, ticket)
