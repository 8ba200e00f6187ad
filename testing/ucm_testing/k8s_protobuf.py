"""Kubernetes' protobuf encoding of what helm sends, read into the JSON object it stands for.

client-go (helm, kubectl) sends core objects as ``application/vnd.kubernetes.protobuf`` and never
falls back to JSON; kmock reads JSON only. Helm keeps each release in a Secret and deletes it with
DeleteOptions, so to run the real helm against kmock the emulator translates these two. Of a
Secret, what it holds is read (ObjectMeta's identifying fields, labels, annotations, data, type);
of DeleteOptions, nothing (kmock deletes at once, whatever the propagation policy). A body of any
other kind is refused, so nothing is silently half-read.

Field numbers are those of k8s.io/api/core/v1/generated.proto and apimachinery's
runtime.Unknown and ObjectMeta.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

MAGIC = b"k8s\x00"


class NotRead(ValueError):
    pass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a message: varints as ints, length-delimited fields as bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            length, i = _varint(buf, i)
            yield number, buf[i : i + length]
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"protobuf wire type {wire} not read here")


def _map(entries: list[bytes]) -> dict[str, bytes]:
    out = {}
    for entry in entries:
        fields = dict(_fields(entry))
        out[bytes(fields.get(1, b"")).decode()] = bytes(fields.get(2, b""))
    return out


def _meta(buf: bytes) -> dict[str, Any]:
    names = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: dict[str, Any] = {}
    labels: list[bytes] = []
    annotations: list[bytes] = []
    for number, value in _fields(buf):
        if number in names and isinstance(value, bytes) and value:  # proto2 sends unset strings empty
            meta[names[number]] = value.decode()
        elif number == 11 and isinstance(value, bytes):
            labels.append(value)
        elif number == 12 and isinstance(value, bytes):
            annotations.append(value)
    if labels:
        meta["labels"] = {k: v.decode() for k, v in _map(labels).items()}
    if annotations:
        meta["annotations"] = {k: v.decode() for k, v in _map(annotations).items()}
    return meta


def from_protobuf(body: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf-encoded v1 Secret or DeleteOptions (``NotRead`` for anything else)."""
    if not body.startswith(MAGIC):
        raise NotRead("not a Kubernetes protobuf body (no k8s\\0 magic)")
    envelope = dict(_fields(body[len(MAGIC) :]))
    type_meta = dict(_fields(bytes(envelope.get(1, b""))))
    api_version, kind = bytes(type_meta.get(1, b"")).decode(), bytes(type_meta.get(2, b"")).decode()
    if (api_version, kind) == ("v1", "DeleteOptions"):
        return {"apiVersion": "v1", "kind": "DeleteOptions"}
    if (api_version, kind) != ("v1", "Secret"):
        raise NotRead(f"a {api_version}/{kind}: only v1 Secrets and DeleteOptions are read")
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret"}
    data: list[bytes] = []
    for number, value in _fields(bytes(envelope.get(2, b""))):
        if not isinstance(value, bytes):
            continue
        if number == 1:
            obj["metadata"] = _meta(value)
        elif number == 2:
            data.append(value)
        elif number == 3:
            obj["type"] = value.decode()
    if data:
        obj["data"] = {k: base64.b64encode(v).decode() for k, v in _map(data).items()}
    return obj
