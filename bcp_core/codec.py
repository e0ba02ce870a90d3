"""Safe codec: non-tensor values as JSON with a few tags (docs/format.md, "Value"), and the
records ranks exchange (plans, reports) as JSON.

Decoding never runs code. Pickle is used only when the caller opts in, on save to write it and on
load to read it. Records are frozen dataclasses registered with `record`; decoding builds only
registered classes, each field checked against its annotation. Values and records come from files
and other ranks: malformed ones raise MetadataError naming what is wrong, never a raw Python error,
and nothing is allocated from a claim (a shape, a nesting) before it is checked.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import pickle
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import torch

from .errors import MetadataError, PickleNotAllowedError, UnsupportedValueError
from .metadata import MAX_VALUE_DEPTH, brief, dtype_from_name, dtype_name, element_size, parse_shape

_TAGS = ("__tuple__", "__set__", "__frozenset__", "__dict__", "__float__", "__bytes__", "__dtype__",
         "__device__", "__tensor__", "__ndarray__", "__pickle__")
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Inline tensors in values are for small things (a scalar, a seed); big ones belong in data files.
MAX_INLINE_TENSOR_BYTES = 1 << 20


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: Any, where: str, nbytes: int | None = None) -> bytes:
    """The bytes base64 string `s` holds; with `nbytes`, refused unless it holds exactly that many
    (checked on the string's length, before decoding)."""
    if type(s) is not str:
        raise MetadataError(f"{where}: expected a base64 string, got {type(s).__name__}")
    if nbytes is not None and len(s) != 4 * -(-nbytes // 3):
        raise MetadataError(f"{where}: {len(s)} characters of base64 data do not hold the {nbytes} bytes its "
                            "dtype and shape claim")
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:  # binascii.Error, and non-ASCII text
        raise MetadataError(f"{where}: invalid base64 data ({e})") from None


def encode(value: Any, where: str = "value", allow_pickle: bool = False) -> Any:
    """Turn a value into its JSON form; raise UnsupportedValueError naming `where` if impossible."""
    return _encode(value, where, allow_pickle, 0)


def _nest(depth: int, where: str) -> int:
    """The JSON nesting level of a list or object placed `depth` levels deep: refused past MAX_VALUE_DEPTH."""
    if depth > MAX_VALUE_DEPTH:
        raise UnsupportedValueError(f"{where}: the value nests lists, tuples and dicts deeper than {MAX_VALUE_DEPTH} "
                                    "levels in its saved form (or contains itself)")
    return depth


def _encode(value: Any, where: str, allow_pickle: bool, depth: int) -> Any:
    """`encode` for a value placed inside `depth` JSON lists and objects."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    _nest(depth + 1, where)  # every other form is a list or an object
    if isinstance(value, float):
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        d = _nest(depth + 1, where)
        return [_encode(v, f"{where}[{i}]", allow_pickle, d) for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        d = _nest(depth + 2, where)  # {"__tuple__": [...]}
        return {"__tuple__": [_encode(v, f"{where}[{i}]", allow_pickle, d) for i, v in enumerate(value)]}
    if type(value) in (set, frozenset):
        d = _nest(depth + 2, where)  # {"__set__": [...]}
        items = [_encode(v, f"{where} element", allow_pickle, d) for v in value]
        # a set has no order: sorted by the elements' JSON, so equal sets are saved alike on every rank
        items.sort(key=lambda e: json.dumps(e, sort_keys=True))
        return {"__set__" if type(value) is set else "__frozenset__": items}
    if isinstance(value, dict) and type(value) is dict:
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            d = _nest(depth + 1, where)
            return {k: _encode(v, f"{where}.{k}", allow_pickle, d) for k, v in value.items()}
        d = _nest(depth + 3, where)  # {"__dict__": [[key, value], ...]}
        return {"__dict__": [[_encode(k, f"{where} key", allow_pickle, d),
                              _encode(v, f"{where}[{k!r}]", allow_pickle, d)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": _b64(bytes(value))}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        _nest(depth + 3, where)  # {"__tensor__": {"shape": [...]}}
        t = value.detach().cpu().contiguous()
        if t.numel() * t.element_size() > MAX_INLINE_TENSOR_BYTES:
            raise UnsupportedValueError(f"{where}: tensor of {t.numel() * t.element_size()} bytes inside a "
                                        "non-tensor value; put it directly in a dict so it is saved as a tensor")
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                               "data": _b64(t.reshape(-1).view(torch.uint8).numpy().tobytes())}}
    np = _numpy()
    if np is not None:
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            _nest(depth + 3, where)  # {"__ndarray__": {"shape": [...]}}
            a = np.ascontiguousarray(value)
            return {"__ndarray__": {"dtype": a.dtype.str, "shape": list(a.shape), "data": _b64(a.tobytes())}}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return _encode(value.item(), where, allow_pickle, depth)
    if allow_pickle:
        return {"__pickle__": _b64(pickle.dumps(value, protocol=4))}
    raise UnsupportedValueError(
        f"{where}: cannot save a value of type {type(value).__module__}.{type(value).__qualname__} with the "
        "safe codec (JSON values, tuples, sets, bytes, dtypes, tensors, numpy arrays). Convert it, or pass "
        "allow_pickle=True to bcp.save (loading it will then need allow_pickle=True too)")


def decode(raw: Any, where: str = "value", allow_pickle: bool = False) -> Any:
    """The value JSON form `raw` encodes. Malformed input (a bad tag body, base64, dtype, shape,
    nesting deeper than MAX_VALUE_DEPTH) raises MetadataError naming `where`; nothing is allocated
    from a claim before it is checked against the data that backs it."""
    return _decode(raw, where, allow_pickle, 0)


def _decode(raw: Any, where: str, allow_pickle: bool, depth: int) -> Any:
    """`decode` for a JSON value inside `depth` lists and objects."""
    if raw is None or isinstance(raw, (bool, int, float, str)):
        return raw
    if depth >= MAX_VALUE_DEPTH:
        raise MetadataError(f"{where}: lists and objects nest deeper than {MAX_VALUE_DEPTH} levels")
    if isinstance(raw, list):
        return [_decode(v, where, allow_pickle, depth + 1) for v in raw]
    if not isinstance(raw, dict):
        raise MetadataError(f"{where}: unexpected JSON value {type(raw).__name__}")
    if len(raw) == 1:
        (tag, body), = raw.items()
        if tag in _TAGS:
            return _decode_tag(tag, body, where, allow_pickle, depth + 1)
    return {k: _decode(v, f"{where}.{k}", allow_pickle, depth + 1) for k, v in raw.items()}


def _decode_tag(tag: str, body: Any, where: str, allow_pickle: bool, depth: int) -> Any:
    """The value of tag object {tag: body}; `body` lies inside `depth` lists and objects."""
    if tag == "__tuple__":
        _need_type(body, list, where, tag)
        return tuple(_decode(v, where, allow_pickle, depth + 1) for v in body)
    if tag in ("__set__", "__frozenset__"):
        _need_type(body, list, where, tag)
        elements = [_decode(v, where, allow_pickle, depth + 1) for v in body]
        try:
            return set(elements) if tag == "__set__" else frozenset(elements)
        except TypeError as e:
            raise MetadataError(f"{where}: {tag} holds an element that cannot be in a set ({e})") from None
    if tag == "__dict__":
        _need_type(body, list, where, tag)
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise MetadataError(f"{where}: {tag} holds {type(pair).__name__} where a [key, value] pair belongs")
            key = _hashable(_decode(pair[0], where, allow_pickle, depth + 2))
            value = _decode(pair[1], where, allow_pickle, depth + 2)
            try:
                out[key] = value
            except TypeError:
                raise MetadataError(f"{where}: {tag} key of type {type(key).__name__} cannot be a dict key") from None
        return out
    if tag == "__float__":
        if body not in ("nan", "inf", "-inf"):
            raise MetadataError(f"{where}: {tag} must be \"nan\", \"inf\" or \"-inf\", got {brief(body)}")
        return _FLOATS[body]
    if tag == "__bytes__":
        return _unb64(body, where)
    if tag == "__dtype__":
        return dtype_from_name(body)
    if tag == "__device__":
        _need_type(body, str, where, tag)
        try:
            return torch.device(body)
        except (RuntimeError, ValueError, TypeError) as e:
            raise MetadataError(f"{where}: invalid device {body[:40]!r} ({e})") from None
    if tag == "__tensor__":
        _need_type(body, dict, where, tag)
        dtype = dtype_from_name(body.get("dtype"))
        shape = parse_shape(body.get("shape"), where, "inline tensor shape")
        nbytes = math.prod(shape) * element_size(dtype)
        if nbytes > MAX_INLINE_TENSOR_BYTES:
            raise MetadataError(f"{where}: inline tensor of shape {list(shape)} would take {nbytes} bytes, more than "
                                f"the {MAX_INLINE_TENSOR_BYTES} a value may hold")
        data = bytearray(_unb64(body.get("data"), where, nbytes))
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    if tag == "__ndarray__":
        np = _numpy()
        if np is None:
            raise UnsupportedValueError(f"{where}: numpy array in checkpoint but numpy is not installed")
        _need_type(body, dict, where, tag)
        _need_type(body.get("dtype"), str, where, f"{tag} dtype")
        try:
            dt = np.dtype(body["dtype"])
        except (TypeError, ValueError) as e:
            raise MetadataError(f"{where}: invalid numpy dtype {body['dtype'][:40]!r} ({e})") from None
        if dt.kind not in "biufc":
            raise UnsupportedValueError(f"{where}: numpy dtype {dt} refused (object arrays could run code)")
        shape = parse_shape(body.get("shape"), where, "numpy array shape")
        # the data is already in memory as text: the array is no larger than what backs it
        data = _unb64(body.get("data"), where, math.prod(shape) * dt.itemsize)
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()
    if tag == "__pickle__":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{where}: the checkpoint holds a pickled value; unpickling can run arbitrary code. If you "
                "trust this checkpoint, load it with allow_pickle=True")
        data = _unb64(body, where)
        try:
            return pickle.loads(data)  # opt-in only: allow_pickle=True on load
        except Exception as e:  # noqa: BLE001 - whatever a broken pickle raises, it is a bad value
            raise MetadataError(f"{where}: the pickled value cannot be unpickled ({type(e).__name__}: {e})") from e
    raise AssertionError(tag)


def _need_type(v: Any, kind: type, where: str, what: str) -> None:
    if type(v) is not kind:
        raise MetadataError(f"{where}: {what} must be a {kind.__name__}, got {type(v).__name__}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _numpy():
    try:
        import numpy
        return numpy
    except ImportError:
        return None


# ----------------------------------------------------------------------------- records

_RECORDS: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}  # each record class's field names, in order
_WIRE_FIELDS: dict[type, tuple[_WireField, ...]] = {}  # built at a class's first from_wire
_WIRE_CHECKS: dict[type, tuple[tuple, ...]] = {}  # the same, as plain tuples: from_wire's inner loop
_MAX_RECORD_DEPTH = 8  # records inside records inside ...: deeper is not a bcp message


def record(cls: type) -> type:
    """Register frozen dataclass `cls` as a record that `to_wire` / `from_wire` carry between ranks.

    Wire form: {"record": <class name>, "fields": [<field values in order>]}. Field values are JSON
    values or records (alone or in a list); a list comes back as a tuple (one level: deeper lists
    stay lists, which keeps large plans cheap to decode). `from_wire` checks each field against its
    annotation to the same depth (see `_WireField`).
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__} must be a frozen dataclass to be a record")
    _RECORDS[cls.__name__] = cls
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


def to_wire(rec: Any) -> dict:
    """A registered record as JSON-ready values."""
    names = _FIELDS.get(type(rec))
    if names is None:
        raise TypeError(f"{type(rec).__name__} is not a registered record")
    fields = []
    for name in names:
        v = getattr(rec, name)
        if type(v) in _FIELDS:
            v = to_wire(v)
        elif isinstance(v, (list, tuple)) and v and type(v[0]) in _FIELDS:
            v = [to_wire(x) for x in v]
        fields.append(v)
    return {"record": type(rec).__name__, "fields": fields}


def _is_wire_record(v: Any) -> bool:
    return type(v) is dict and len(v) == 2 and "record" in v and "fields" in v


def from_wire(raw: Any, expected: type | tuple[type, ...] | None = None) -> Any:
    """The record `raw` encodes; MetadataError if it is not one of the `expected` classes, or if a
    field does not have its annotated type."""
    return _from_wire(raw, expected, 0)


def _from_wire(raw: Any, expected: type | tuple[type, ...] | None, depth: int) -> Any:
    """`from_wire` for a record inside `depth` others."""
    cls = _RECORDS.get(raw["record"]) if _is_wire_record(raw) and type(raw["record"]) is str else None
    if cls is None:
        raise MetadataError(f"expected a bcp record, got {brief(raw)}")
    if expected is not None and not issubclass(cls, expected):
        names = [c.__name__ for c in (expected if isinstance(expected, tuple) else (expected,))]
        raise MetadataError(f"expected a record of type {' or '.join(names)}, got {cls.__name__}")
    if depth >= _MAX_RECORD_DEPTH:
        raise MetadataError(f"record {cls.__name__} nested inside {depth} others")
    checks = _WIRE_CHECKS.get(cls) or _wire_checks(cls)
    values = raw["fields"]
    if type(values) is not list or len(values) != len(checks):
        raise MetadataError(f"record {cls.__name__}: expected {len(checks)} fields, got {brief(values)}")
    out = []
    for (records, exact, items), v in zip(checks, values):
        if type(v) is list:
            v = tuple(_from_wire(x, None, depth + 1) for x in v) if records and v and _is_wire_record(v[0]) \
                else tuple(v)
        elif records and type(v) is dict and _is_wire_record(v):
            v = _from_wire(v, None, depth + 1)
        if (exact and type(v) not in exact) or (items is not None and type(v) is tuple
                                                and not items.issuperset(map(type, v))):
            f = _WIRE_FIELDS[cls][len(out)]
            raise MetadataError(f"record {cls.__name__} field {f.name!r} must be {f.text}, got {brief(v)}")
        out.append(v)
    return cls(*out)


# ----------------------------------------------------------------------------- record field types

@dataclass(frozen=True)
class _WireField:
    """What `from_wire` accepts in one field of a record, from its annotation, as from_wire builds
    values: records are built, a field's list becomes a tuple, lists inside it stay lists.

    `types`: the exact types the value may have (empty: any). `items`: for a tuple of scalars or
    records, the exact types of its items (None: unchecked). `records`: whether the field may hold
    records. Rows (a tuple of NamedTuples or of tuples) and what lies deeper are checked by the code
    that unpacks them: checking every row here nearly doubled from_wire's time on a large plan.
    """

    name: str
    text: str
    types: tuple[type, ...]
    items: frozenset[type] | None
    records: bool


def _wire_checks(cls: type) -> tuple[tuple, ...]:
    hints = typing.get_type_hints(cls)
    fields = []
    for name in _FIELDS[cls]:
        hint = hints[name]
        accepted, records = _accepted(hint)
        items = None
        element = _tuple_element(hint)
        if element is not None and not _is_row(element):
            item_types, item_records = _accepted(element)
            items = frozenset(item_types) or None
            records = records or item_records
        text = hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else \
            re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(hint))  # module paths dropped
        fields.append(_WireField(name, text, accepted, items, records))
    _WIRE_FIELDS[cls] = tuple(fields)
    _WIRE_CHECKS[cls] = checks = tuple((f.records, f.types, f.items) for f in fields)
    return checks


def _accepted(hint: Any) -> tuple[tuple[type, ...], bool]:
    """The exact types a field annotated `hint` may have once decoded (empty: any; a list became a
    tuple), and whether it may be a record."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return (), True
    if origin is typing.Union or origin is types.UnionType:
        parts = [_accepted(a) for a in typing.get_args(hint)]
        if any(not t for t, _ in parts):
            return (), True
        return tuple(x for t, _ in parts for x in t), any(r for _, r in parts)
    if hint is type(None):
        return (type(None),), False
    if hint is float:
        return (int, float), False
    if hint in (int, str, bool):
        return (hint,), False
    if hint is dict or origin is dict:
        return (dict,), False
    if hint in (tuple, list) or origin in (tuple, list) or _is_row(hint):
        return (tuple,), False
    if hint in _FIELDS:
        return (hint,), True
    raise TypeError(f"record field annotation {hint!r} is not one from_wire can check")


def _tuple_element(hint: Any) -> Any:
    """The item annotation of tuple[X, ...] or list[X] (with `| None` around it), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        elements = [e for a in typing.get_args(hint) if (e := _tuple_element(a)) is not None]
        return elements[0] if len(elements) == 1 else None
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    if typing.get_origin(hint) is list and len(args) == 1:
        return args[0]
    return None


def _is_row(hint: Any) -> bool:
    """A NamedTuple or a tuple or list annotation: a row, sent as a list."""
    return (isinstance(hint, type) and issubclass(hint, (tuple, list))) or typing.get_origin(hint) in (tuple, list)
