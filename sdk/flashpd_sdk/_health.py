"""grpc.health.v1 messages without the grpcio-health-checking package.

The two messages are built from a descriptor in a private pool: registering the standard
`grpc/health/v1/health.proto` in the default pool would collide with grpcio-health-checking
when both are loaded in one process (e.g. a server and a client in one test).
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

CHECK_METHOD = "/grpc.health.v1.Health/Check"
_PACKAGE = "grpc.health.v1"
_STATUSES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _messages():
    fd = descriptor_pb2.FileDescriptorProto(name="flashpd_sdk/_health.proto", package=_PACKAGE, syntax="proto3")
    f = descriptor_pb2.FieldDescriptorProto
    request = fd.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    response = fd.message_type.add(name="HealthCheckResponse")
    status_enum = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(_STATUSES):
        status_enum.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=f.TYPE_ENUM,
        label=f.LABEL_OPTIONAL,
        type_name=f".{_PACKAGE}.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
        for name in ("HealthCheckRequest", "HealthCheckResponse")
    )


HealthCheckRequest, HealthCheckResponse = _messages()


def status_name(response) -> str:
    """ "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
    return _STATUSES[response.status] if response.status < len(_STATUSES) else "UNKNOWN"
