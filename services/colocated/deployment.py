"""`ColocatedServer`: the colocated worker as a Ray Serve deployment (one replica = one worker)."""

from __future__ import annotations

from flashpd.services.worker.deployment import StreamingDeployment


class ColocatedServer(StreamingDeployment):
    role = "colocated"

    def _make_worker(self, engine, config, ref):
        from flashpd.services.colocated.server import ColocatedWorker

        return ColocatedWorker(engine, config, ref)

    async def _drain_worker(self, deadline_s: float) -> int:
        """Refuse new requests; the streams running here finish in place (a colocated stream
        has no KV elsewhere to move to). Returns how many run."""
        return await self.worker.drain()
