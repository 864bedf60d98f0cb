"""Typed errors, one per gRPC status code the server uses.

`field` names the request field an InvalidArgument is about (from the server's `flashpd-field`
trailing metadata, or the SDK's own argument checks).
"""

from __future__ import annotations

import grpc

FIELD_METADATA_KEY = "flashpd-field"


class FlashpdError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, field: str | None = None, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field
        if code is not None:
            self.code = code


class InvalidArgument(FlashpdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(FlashpdError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(FlashpdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(FlashpdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(FlashpdError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(FlashpdError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(FlashpdError):
    """No API key, or not one the server knows (see `Client(api_key=...)`)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(FlashpdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(FlashpdError):
    """INTERNAL, UNKNOWN and any other status the server does not document."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[FlashpdError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        Cancelled,
        Unauthenticated,
        PermissionDenied,
    )
}


def from_rpc_error(error: grpc.RpcError) -> FlashpdError:
    """The typed error for a failed call (sync or grpc.aio)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    cls = _BY_CODE.get(code, InternalError)
    return cls(f"{code.name}: {details}", field=_field(error), code=code)


def _field(error: grpc.RpcError) -> str | None:
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == FIELD_METADATA_KEY:
            return value
    return None
