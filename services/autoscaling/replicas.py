"""The flashpd deployments with Serve's `record_autoscaling_stats` hook.

Each replica reports its load every `metrics_interval_s` of its autoscaling config; Serve averages
the reports over `look_back_period_s` and hands them to the application-level `JointPolicy`
(services/autoscaling/serve.py). Workers report their `WorkerStats` fields; routers report
requests in flight and recent p90 TTFT/ITL, and refresh their per-worker `/metrics` gauges from
the live view of workers they read from Redis.
"""

from __future__ import annotations

import asyncio
import logging

from flashpd.services.api import WorkerStats
from flashpd.services.autoscaling.serve import WORKER_METRICS
from flashpd.services.colocated.deployment import ColocatedServer
from flashpd.services.decode.deployment import DecodeServer
from flashpd.services.prefill.deployment import PrefillServer
from flashpd.services.router.deployment import Router

log = logging.getLogger(__name__)

VIEW_REFRESH_S = 1.0
GRPC_DRAIN_MARGIN_S = 5.0  # the base shutdown's own time, inside graceful_shutdown_timeout_s


def worker_load_metrics(stats: WorkerStats) -> dict[str, float]:
    return {name: float(getattr(stats, name)) for name in WORKER_METRICS}


class ReportingPrefillServer(PrefillServer):
    async def record_autoscaling_stats(self) -> dict[str, float]:
        return worker_load_metrics(await self.stats())


class ReportingDecodeServer(DecodeServer):
    async def record_autoscaling_stats(self) -> dict[str, float]:
        return worker_load_metrics(await self.stats())


class ReportingColocatedServer(ColocatedServer):
    async def record_autoscaling_stats(self) -> dict[str, float]:
        return worker_load_metrics(await self.stats())


class ReportingRouter(Router):
    """The router plus its autoscaling report and the per-worker gauges' refresh loop."""

    async def __serve_build_asgi_app__(self):
        app = await super().__serve_build_asgi_app__()
        self._view_task = asyncio.create_task(self._refresh_worker_gauges())
        return app

    async def _refresh_worker_gauges(self) -> None:
        while True:
            try:
                workers = []
                for placement in self.orchestrator.placements.values():
                    workers.extend((await placement.live_view()).workers)
                self.metrics.observe_workers(workers)
            except Exception as exc:  # Redis briefly away: keep the last view, try again
                log.warning("worker view refresh failed: %r", exc)
            await asyncio.sleep(VIEW_REFRESH_S)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        metrics = getattr(self, "metrics", None)  # None until the ASGI app is built
        return metrics.autoscaling_stats() if metrics is not None else {}

    async def __del__(self) -> None:
        """Scale-down: stop taking gRPC calls (new connections go to the other replicas sharing
        the port) and let the streams in flight finish within the router's
        graceful_shutdown_timeout_s (less a margin), then the base shutdown."""
        task = getattr(self, "_view_task", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        grpc = getattr(self, "grpc", None)
        if grpc is not None:
            budget = self.args["router"]["graceful_shutdown_timeout_s"]
            await grpc.stop(max(1.0, budget - GRPC_DRAIN_MARGIN_S))
        await super().__del__()
