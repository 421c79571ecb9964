"""Protobuf message classes built at import from tables of fields.

Used where no maintained package ships generated Python code that today's protobuf runtime
loads: the OTLP views of `otlp_view` (declared by us, to skip fields), and the Jaeger
`model.proto` and Zipkin `zipkin.proto` messages that the Collector's Kafka exporter writes
(`opentelemetry-exporter-jaeger-proto-grpc` is deprecated, its last release pins
`googleapis-common-protos<1.60`, and both it and `opentelemetry-exporter-zipkin-proto-http`
ship code from protoc < 3.20 that protobuf >= 4 refuses to load; the latter also pins
`protobuf~=3.12`). The field numbers and types are copied from those `.proto` files; the
tests check the classes against bytes written by the real Collector where one is built.

A field is `(name, number, type, type_name, label)`: `type` a `FieldDescriptorProto.TYPE_*`,
`type_name` a message or enum of the same file (`"Span"`, `"Span.Kind"`) or an absolute name
(`".google.protobuf.Timestamp"`), `label` one of `"optional"`, `"repeated"` or `"map"` (a
`map<string, type>`, e.g. Zipkin's tags).
"""

from __future__ import annotations

from typing import Literal

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

F = descriptor_pb2.FieldDescriptorProto
Label = Literal["optional", "repeated", "map"]
Field = tuple[str, int, int, str, Label]


def message_classes(
    file_name: str,
    package: str,
    messages: dict[str, list[Field]],
    *,
    enums: dict[str, list[tuple[str, int]]] | None = None,
    dependencies: tuple[str, ...] = (),
) -> dict[str, type[Message]]:
    """Build one `.proto` file into the default pool; its message classes by (dotted) name.

    `messages` and `enums` may name nested types as `"Outer.Inner"` (the outer one first).
    `dependencies` are the file names of messages referenced by absolute name.
    """
    file = descriptor_pb2.FileDescriptorProto(
        name=file_name, package=package, syntax="proto3", dependency=list(dependencies)
    )
    declared: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name, fields in messages.items():
        outer, _, inner = name.rpartition(".")
        message = (declared[outer].nested_type if outer else file.message_type).add(name=inner)
        declared[name] = message
        for field_name, number, field_type, type_name, label in fields:
            _add_field(message, package, f"{package}.{name}", field_name, number, field_type, type_name, label)
    for name, values in (enums or {}).items():
        outer, _, inner = name.rpartition(".")
        enum = (declared[outer].enum_type if outer else file.enum_type).add(name=inner)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    pool = descriptor_pool.Default()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for name in messages
    }


def _add_field(
    message: descriptor_pb2.DescriptorProto,
    package: str,
    full_name: str,
    name: str,
    number: int,
    field_type: int,
    type_name: str,
    label: Label,
) -> None:
    field = message.field.add(
        name=name,
        number=number,
        type=F.TYPE_MESSAGE if label == "map" else field_type,
        label=F.LABEL_OPTIONAL if label == "optional" else F.LABEL_REPEATED,
    )
    if label == "map":
        # A map is a repeated nested `<Name>Entry {key = 1; value = 2}` marked as a map entry.
        entry = message.nested_type.add(name="".join(part.title() for part in name.split("_")) + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        value = entry.field.add(name="value", number=2, type=field_type, label=F.LABEL_OPTIONAL)
        if type_name:
            value.type_name = _absolute(package, type_name)
        field.type_name = f".{full_name}.{entry.name}"
    elif type_name:
        field.type_name = _absolute(package, type_name)


def _absolute(package: str, type_name: str) -> str:
    return type_name if type_name.startswith(".") else f".{package}.{type_name}"
