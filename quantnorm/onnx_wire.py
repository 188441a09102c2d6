"""The node list of an ONNX file, and where its weights live, without parsing its weights (and
without importing onnx).

onnx.load parses every initializer: 1 GB and seconds on Gemma 3's models, to read a few hundred
op types. The protobuf wire format lets us walk the ModelProto -> GraphProto -> NodeProto fields of
a memory-mapped file and step over each initializer by its length prefix. The same format lets
``write_model_streaming`` write a model one initializer at a time, where onnx.save_model holds two
serialized copies of every weight at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import mmap
import os
from collections.abc import Iterable, Iterator, Mapping

# Field numbers from onnx.proto: ModelProto.graph = 7, ModelProto.functions = 25;
# GraphProto.node = 1; FunctionProto.node = 7; NodeProto.input = 1, output = 2, op_type = 4.
_MODEL_GRAPH, _MODEL_FUNCTIONS, _GRAPH_NODE, _FUNCTION_NODE = 7, 25, 1, 7
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE = 1, 2, 4
# GraphProto.initializer = 5; TensorProto.external_data = 13 (StringStringEntryProto: key 1, value 2).
_GRAPH_INITIALIZER, _TENSOR_EXTERNAL_DATA, _ENTRY_KEY, _ENTRY_VALUE = 5, 13, 1, 2


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of each field of the message in buf[start:end];
    for a varint or fixed field start:end holds its bytes."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, after = _varint(buf, pos)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            after = pos + length
        elif wire == 5:
            after = pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} at byte {pos}")
        if after > end:
            raise ValueError(f"protobuf field {field} runs past its message (byte {after} > {end})")
        yield field, wire, pos, after
        pos = after


@contextlib.contextmanager
def _mapped(path: str | os.PathLike) -> Iterator[mmap.mmap]:
    """The file at ``path``, memory-mapped read-only (ValueError for an empty file)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield buf


def onnx_nodes(path: str | os.PathLike) -> list[tuple[str, list[str], list[str]]]:
    """``(op_type, inputs, outputs)`` of every node of the model's graph, then of its local
    functions, read without parsing the initializers (see above). Subgraphs (If/Loop bodies) are
    not walked: their ops are not QDQ or integer kernels in any model we write."""
    nodes: list[tuple[str, list[str], list[str]]] = []

    def node(buf, start: int, end: int) -> None:
        op, inputs, outputs = "", [], []
        for field, wire, a, b in _fields(buf, start, end):
            if wire != 2:
                continue
            if field == _NODE_OP_TYPE:
                op = bytes(buf[a:b]).decode()
            elif field == _NODE_INPUT:
                inputs.append(bytes(buf[a:b]).decode())
            elif field == _NODE_OUTPUT:
                outputs.append(bytes(buf[a:b]).decode())
        nodes.append((op, inputs, outputs))

    with _mapped(path) as buf:
        functions = []
        for field, wire, a, b in _fields(buf, 0, len(buf)):
            if wire == 2 and field == _MODEL_GRAPH:
                for f2, w2, a2, b2 in _fields(buf, a, b):
                    if w2 == 2 and f2 == _GRAPH_NODE:
                        node(buf, a2, b2)
            elif wire == 2 and field == _MODEL_FUNCTIONS:
                functions.append((a, b))
        for a, b in functions:
            for f2, w2, a2, b2 in _fields(buf, a, b):
                if w2 == 2 and f2 == _FUNCTION_NODE:
                    node(buf, a2, b2)
    return nodes


def external_data_locations(path: str | os.PathLike) -> set[str]:
    """The ``location`` of every external-data entry of the graph's initializers (files beside the
    model that hold its weights); empty for a model whose weights are inline. Each initializer's
    raw bytes are stepped over, not read."""
    locations: set[str] = set()
    with _mapped(path) as buf:
        for a2, b2 in _graph_initializers(buf):
            for f3, w3, a3, b3 in _fields(buf, a2, b2):
                if w3 == 2 and f3 == _TENSOR_EXTERNAL_DATA:
                    key, value = _entry(buf, a3, b3)
                    if key == "location" and value is not None:
                        locations.add(value)
    return locations


def _graph_initializers(buf) -> Iterator[tuple[int, int]]:
    """Where each graph initializer (a TensorProto) lies in the mapped model file: start, end."""
    for field, wire, a, b in _fields(buf, 0, len(buf)):
        if wire == 2 and field == _MODEL_GRAPH:
            for f2, w2, a2, b2 in _fields(buf, a, b):
                if w2 == 2 and f2 == _GRAPH_INITIALIZER:
                    yield a2, b2


def _entry(buf, start: int, end: int) -> tuple[str | None, str | None]:
    """A StringStringEntryProto's key and value (None where absent)."""
    entry = {k: bytes(buf[x:y]).decode() for k, w, x, y in _fields(buf, start, end) if w == 2}
    return entry.get(_ENTRY_KEY), entry.get(_ENTRY_VALUE)


# TensorProto.dims = 1, data_type = 2, name = 8, raw_data = 9, data_location = 14 (EXTERNAL = 1).
_TENSOR_DIMS, _TENSOR_DATA_TYPE = 1, 2
_TENSOR_NAME, _TENSOR_RAW_DATA, _TENSOR_DATA_LOCATION = 8, 9, 14
_EXTERNAL = 1


@dataclasses.dataclass(frozen=True)
class TensorPlace:
    """Where one initializer's raw bytes lie: ``file`` (the model file itself for inline
    ``raw_data``, or an external-data file beside it) and the byte range ``start:end`` in it."""

    dims: tuple[int, ...]
    data_type: int
    file: str
    start: int
    end: int


def initializer_places(path: str | os.PathLike) -> dict[str, TensorPlace]:
    """Each graph initializer of the file at ``path`` stored as raw bytes, inline (``raw_data``) or
    in an external-data file beside it: name -> where its bytes lie. Only the tensors' headers are
    read (reading one weight through onnx.load parses every weight of the model first: 1.7 GB for
    Gemma 3's graph). Tensors in typed fields (float_data, ...) are not listed."""
    directory = os.path.dirname(os.fspath(path))
    places: dict[str, TensorPlace] = {}
    with _mapped(path) as buf:
        for a2, b2 in _graph_initializers(buf):
            name, dims, data_type, raw, external = None, [], 0, None, {}
            for f3, w3, a3, b3 in _fields(buf, a2, b2):
                if f3 == _TENSOR_NAME and w3 == 2:
                    name = bytes(buf[a3:b3]).decode()
                elif f3 == _TENSOR_DIMS and w3 == 0:
                    dims.append(_varint(buf, a3)[0])
                elif f3 == _TENSOR_DIMS and w3 == 2:   # packed
                    pos = a3
                    while pos < b3:
                        value, pos = _varint(buf, pos)
                        dims.append(value)
                elif f3 == _TENSOR_DATA_TYPE and w3 == 0:
                    data_type = _varint(buf, a3)[0]
                elif f3 == _TENSOR_RAW_DATA and w3 == 2:
                    raw = (os.fspath(path), a3, b3)
                elif f3 == _TENSOR_EXTERNAL_DATA and w3 == 2:
                    key, value = _entry(buf, a3, b3)
                    if key is not None and value is not None:
                        external[key] = value
            if "location" in external:
                raw = _external_range(directory, external)
            if name is not None and raw is not None:
                places[name] = TensorPlace(tuple(dims), data_type, *raw)
    return places


def _external_range(directory: str, entries: Mapping[str, str]) -> tuple[str, int, int]:
    """(file, start, end) of an external-data tensor from its ``location``/``offset``/``length``."""
    file = os.path.join(directory, entries["location"])
    offset = int(entries.get("offset", 0))
    end = offset + int(entries["length"]) if "length" in entries else os.path.getsize(file)
    return file, offset, end


@contextlib.contextmanager
def raw_initializers(path: str | os.PathLike) -> Iterator[dict[str, tuple[tuple[int, ...], int, memoryview]]]:
    """``initializer_places`` as views of the memory-mapped files: name -> (dims, ONNX data type,
    the bytes). Nothing is copied; the views are valid inside the ``with``."""
    views: list[memoryview] = []
    with contextlib.ExitStack() as stack:
        mapped: dict[str, memoryview] = {}

        def whole(file: str) -> memoryview:
            if file not in mapped:
                mapped[file] = stack.enter_context(memoryview(stack.enter_context(_mapped(file))))
            return mapped[file]

        try:
            found = {}
            for name, place in initializer_places(path).items():
                view = whole(place.file)[place.start:place.end]
                views.append(view)
                found[name] = (place.dims, place.data_type, view)
            yield found
        finally:   # the views before the maps they point into (a map with views cannot close)
            for view in views:
                view.release()


# Smaller weights stay inline: a reference costs about 60 bytes, and ORT reads each one by itself.
REFERENCE_MIN_BYTES = 1024


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _encode(field: int, wire: int, payload) -> bytes:
    """One field: its tag, a length prefix for wire type 2, then ``payload`` (for a varint or fixed
    field, its bytes as ``_fields`` gives them)."""
    head = _encode_varint(field << 3 | wire)
    if wire == 2:
        head += _encode_varint(len(payload))
    return head + bytes(payload)


def _string_entry(key: str, value: str) -> bytes:
    return _encode(_TENSOR_EXTERNAL_DATA, 2, _encode(_ENTRY_KEY, 2, key.encode()) + _encode(_ENTRY_VALUE, 2, value.encode()))


def model_with_weights_by_reference(path: str | os.PathLike, *, min_bytes: int = REFERENCE_MIN_BYTES) -> bytes:
    """The serialized ModelProto of the file at ``path`` with each graph initializer's inline
    ``raw_data`` (of ``min_bytes`` or more) replaced by an external-data reference into that very
    file (``location`` its name, ``offset`` and ``length`` the bytes' place in it).

    A copy of the graph saved in the same directory (ORT resolves ``location`` against the model's
    own directory) then runs on the original's weights, which are never parsed, copied or written:
    tapping a few inner tensors of Gemma 3's 1.1 GB graph took a parse, a shape inference and a
    1.1 GB write per probe. Everything else (nodes, outputs, value_info, functions, subgraphs,
    initializers already external or stored in typed fields) is copied byte for byte."""
    name = os.path.basename(os.fspath(path))

    def tensor(buf, start: int, end: int) -> bytes:
        raw = None
        kept = bytearray()
        for field, wire, a, b in _fields(buf, start, end):
            if field == _TENSOR_RAW_DATA and wire == 2 and b - a >= min_bytes:
                raw = (a, b - a)
            else:
                kept += _encode(field, wire, buf[a:b])
        if raw is None:
            return bytes(buf[start:end])
        offset, length = raw
        kept += _string_entry("location", name) + _string_entry("offset", str(offset)) \
            + _string_entry("length", str(length))
        kept += _encode(_TENSOR_DATA_LOCATION, 0, _encode_varint(_EXTERNAL))
        return bytes(kept)

    out = bytearray()
    with _mapped(path) as buf:
        for field, wire, a, b in _fields(buf, 0, len(buf)):
            if not (wire == 2 and field == _MODEL_GRAPH):
                out += _encode(field, wire, buf[a:b])
                continue
            graph = bytearray()
            for f2, w2, a2, b2 in _fields(buf, a, b):
                if w2 == 2 and f2 == _GRAPH_INITIALIZER:
                    graph += _encode(f2, w2, tensor(buf, a2, b2))
                else:
                    graph += _encode(f2, w2, buf[a2:b2])
            out += _encode(field, wire, graph)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Writing a model one initializer at a time

def without_field(message, *skipped: str):
    """A copy of a protobuf message without the fields named in ``skipped`` (the rest are small:
    the graph's nodes and signatures beside its weights)."""
    shell = type(message)()
    for field, value in message.ListFields():
        if field.name in skipped:
            continue
        if field.is_repeated:
            getattr(shell, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(shell, field.name).CopyFrom(value)
        else:
            setattr(shell, field.name, value)
    return shell


def _field_key(field: int, length: int) -> bytes:
    """A length-delimited field's tag and length prefix."""
    return _encode_varint(field << 3 | 2) + _encode_varint(length)


_COPY_CHUNK = 64 << 20


def write_model_streaming(model, path: str | os.PathLike, *, extra_initializers: Iterable = (),
                          external_from: str | os.PathLike | None = None) -> None:
    """Write ``model`` to ``path`` one initializer at a time: the file onnx.save_model writes, as
    protobuf parses it. onnx.save_model serializes the whole model into one buffer and copies it
    into a Python bytes object (two copies of every weight beside the model's own: 3.4 GB on
    Gemma 3's rotated graph); here the largest tensor is the most held at once.

    ``extra_initializers``: tensors written after the graph's own, as if they were in it (a
    rewrite's new weights need not be copied into the model first). ``external_from``: the
    directory the model's external-data references resolve against; their bytes are copied from
    there in chunks and written inline (a graph read by reference, ``model_with_weights_by_reference``,
    written as a self-contained file without its weights ever in memory).

    How: a protobuf message field that appears more than once is merged by every parser (repeated
    fields appended in order), so the file is the model without its graph, the graph without its
    initializers, then one more ``graph`` field per initializer holding just it (and its raw bytes
    written straight from the tensor, or from the external file, after the tensor's other fields)."""
    with open(path, "wb") as out:
        out.write(without_field(model, "graph").SerializeToString())
        shell = without_field(model.graph, "initializer").SerializeToString()
        out.write(_field_key(_MODEL_GRAPH, len(shell)))
        out.write(shell)
        del shell
        for init in itertools.chain(model.graph.initializer, extra_initializers):
            external = external_from is not None and init.data_location == _EXTERNAL
            if external:
                file, start, end = _external_range(os.fspath(external_from),
                                                   {e.key: e.value for e in init.external_data})
                head = without_field(init, "raw_data", "external_data", "data_location").SerializeToString()
                raw, raw_length = None, end - start
            else:
                head = without_field(init, "raw_data").SerializeToString()
                raw = init.raw_data if init.HasField("raw_data") else None
                raw_length = None if raw is None else len(raw)
            tensor_length = len(head) + (len(_field_key(_TENSOR_RAW_DATA, raw_length)) + raw_length
                                         if raw_length is not None else 0)
            initializer_key = _field_key(_GRAPH_INITIALIZER, tensor_length)
            out.write(_field_key(_MODEL_GRAPH, len(initializer_key) + tensor_length))
            out.write(initializer_key)
            out.write(head)
            if raw_length is not None:
                out.write(_field_key(_TENSOR_RAW_DATA, raw_length))
            if external:
                _copy_range(file, start, end, out)
            elif raw is not None:
                out.write(raw)
            del raw


def _copy_range(file: str, start: int, end: int, out) -> None:
    """Bytes ``start:end`` of ``file`` into ``out``, a chunk at a time (read(), not a map: the page
    cache holds them, not this process)."""
    with open(file, "rb") as f:
        f.seek(start)
        left = end - start
        while left:
            chunk = f.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise ValueError(f"external data {file} ends before byte {end}")
            out.write(chunk)
            left -= len(chunk)
