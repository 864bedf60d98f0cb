"""flashpd SDK: gRPC client for flashpd (DeepSeek-V4.1-Flash, disaggregated prefill/decode).

Sync `Client` and asyncio `AsyncClient` with the same API; typed errors in `flashpd_sdk.errors`.
Depends only on grpcio and protobuf.
"""

from flashpd_sdk._wire import RetryPolicy
from flashpd_sdk.aio import AsyncClient, AsyncGenerateStream
from flashpd_sdk.client import Client, GenerateStream
from flashpd_sdk.errors import (
    Cancelled,
    DeadlineExceeded,
    FlashpdError,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from flashpd_sdk.types import (
    GenerateResult,
    ModelInfo,
    ResponseFormat,
    TokenChunk,
    TokenLogprobs,
    Tool,
    ToolCall,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "FlashpdError",
    "GenerateResult",
    "GenerateStream",
    "InternalError",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ResponseFormat",
    "RetryPolicy",
    "TokenChunk",
    "TokenLogprobs",
    "Tool",
    "ToolCall",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
