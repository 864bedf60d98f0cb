"""Engine roles as small strategy types: what differs between colocated, prefill and decode.

    role        admitted by            runs      logits at end   finishes when            KV after finish
    colocated   add()                  FULL      yes             sampling says so         freed
    prefill     add()                  ENCODER   no              prompt's global KV done  held until release_kv()
    decode      reserve() +            FULL      yes             sampling says so         freed
                kv_arrived()

The decode role's first step replays the last min(replay, N) prompt tokens through all layers
(global writes suppressed) to rebuild the window state, then samples; the scheduler does that
in `kv_arrived`. A preempted request in any role is recomputed locally from its own prefix hit.
"""

from __future__ import annotations

import enum
from typing import Protocol

from flashpd.engine.request import FinishReason, Request


class ForwardPath(enum.Enum):
    FULL = "full"  # all layers and the head
    ENCODER = "encoder"  # layers 0-19 + layer 20's global-KV writes (model_spec.md §11.2)


class Admission(enum.Enum):
    ADD = "add"  # the request arrives with its prompt and is computed here
    RESERVE = "reserve"  # blocks are reserved first; the global KV arrives from a prefill worker


class RolePolicy(Protocol):
    name: str
    path: ForwardPath
    admission: Admission

    def validate(self, request: Request) -> None: ...

    def max_known_tokens(self, request: Request) -> int: ...

    def needs_logits(self, request: Request, end_token: int) -> bool: ...

    def finish_after_compute(self, request: Request) -> FinishReason | None: ...

    def holds_kv_after(self, reason: FinishReason) -> bool: ...


class ColocatedRole:
    name = "colocated"
    path = ForwardPath.FULL
    admission = Admission.ADD

    def validate(self, request: Request) -> None:
        if request.max_tokens is None:
            raise ValueError(f"request {request.request_id!r}: sampling_params needs max_tokens")

    def max_known_tokens(self, request: Request) -> int:
        # The last sampled token is never computed, so at most prompt + max_tokens - 1 hold KV.
        assert request.max_tokens is not None
        return request.num_prompt_tokens + request.max_tokens - 1

    def needs_logits(self, request: Request, end_token: int) -> bool:
        return end_token == request.num_tokens

    def finish_after_compute(self, request: Request) -> FinishReason | None:
        return None  # sampling decides

    def holds_kv_after(self, reason: FinishReason) -> bool:
        return False


class PrefillRole(ColocatedRole):
    name = "prefill"
    path = ForwardPath.ENCODER

    def validate(self, request: Request) -> None:
        if request.num_output_tokens:
            raise ValueError(f"request {request.request_id!r}: a prefill request has no outputs")

    def max_known_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens

    def needs_logits(self, request: Request, end_token: int) -> bool:
        return False

    def finish_after_compute(self, request: Request) -> FinishReason | None:
        done = request.num_computed_tokens >= request.num_prompt_tokens
        return FinishReason.KV_READY if done else None

    def holds_kv_after(self, reason: FinishReason) -> bool:
        # The blocks are the source of the KV push to the decode worker.
        return reason is FinishReason.KV_READY


class DecodeRole(ColocatedRole):
    name = "decode"
    admission = Admission.RESERVE


ROLES: dict[str, RolePolicy] = {role.name: role for role in (ColocatedRole(), PrefillRole(), DecodeRole())}


def role_from_name(name: str) -> RolePolicy:
    if name not in ROLES:
        raise ValueError(f"unknown engine role {name!r}; known: {sorted(ROLES)}")
    return ROLES[name]
