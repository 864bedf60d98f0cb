"""A Ray Serve request router that sends a call to the one replica the flashpd router picked.

The flashpd router chooses prefill and decode workers itself (session binding, prefix credit,
load, from Redis). Worker ids are Serve replica ids, so a call carries `target_worker=<id>`
and this router returns exactly that replica. When the target is gone (scaled down, crashed),
any replica is returned: the worker sees the mismatch and raises UNAVAILABLE, and the
orchestrator places the request again (never silently served by the wrong worker's cache).
Calls without a target (health, stats fan-out) go to the least-loaded candidates.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

TARGET_KWARG = "target_worker"


class PinnedWorkerRouter(RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = None
        if pending_request is not None:
            target = pending_request.kwargs.get(TARGET_KWARG)
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        return [candidate_replicas]
