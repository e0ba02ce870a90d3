"""Safe codec: non-tensor values as JSON with a few tags (docs/format.md, "Value"), and the
records ranks exchange (plans, reports) as JSON.

Decoding never runs code. Pickle is used only when the caller opts in, on save to write it and on
load to read it. Records are frozen dataclasses registered with `record`; decoding builds only
registered classes.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import pickle
from typing import Any

import torch

from .errors import MetadataError, PickleNotAllowedError, UnsupportedValueError
from .metadata import dtype_from_name, dtype_name

_TAGS = ("__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__device__",
         "__tensor__", "__ndarray__", "__pickle__")
# Inline tensors in values are for small things (a scalar, a seed); big ones belong in data files.
MAX_INLINE_TENSOR_BYTES = 1 << 20


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: Any, where: str) -> bytes:
    if not isinstance(s, str):
        raise UnsupportedValueError(f"{where}: expected base64 string")
    return base64.b64decode(s.encode("ascii"), validate=True)


def encode(value: Any, where: str = "value", allow_pickle: bool = False) -> Any:
    """Turn a value into its JSON form; raise UnsupportedValueError naming `where` if impossible."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", allow_pickle) for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        return {"__tuple__": [encode(v, f"{where}[{i}]", allow_pickle) for i, v in enumerate(value)]}
    if isinstance(value, dict) and type(value) is dict:
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, f"{where}.{k}", allow_pickle) for k, v in value.items()}
        return {"__dict__": [[encode(k, f"{where} key", allow_pickle), encode(v, f"{where}[{k!r}]", allow_pickle)]
                             for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": _b64(bytes(value))}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        t = value.detach().cpu().contiguous()
        if t.numel() * t.element_size() > MAX_INLINE_TENSOR_BYTES:
            raise UnsupportedValueError(f"{where}: tensor of {t.numel() * t.element_size()} bytes inside a "
                                        "non-tensor value; put it directly in a dict so it is saved as a tensor")
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                               "data": _b64(t.reshape(-1).view(torch.uint8).numpy().tobytes())}}
    np = _numpy()
    if np is not None:
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            a = np.ascontiguousarray(value)
            return {"__ndarray__": {"dtype": a.dtype.str, "shape": list(a.shape), "data": _b64(a.tobytes())}}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return encode(value.item(), where, allow_pickle)
    if allow_pickle:
        return {"__pickle__": _b64(pickle.dumps(value, protocol=4))}
    raise UnsupportedValueError(
        f"{where}: cannot save a value of type {type(value).__module__}.{type(value).__qualname__} with the "
        "safe codec (JSON values, tuples, bytes, dtypes, tensors, numpy arrays). Convert it, or pass "
        "allow_pickle=True to bcp.save (loading it will then need allow_pickle=True too)")


def decode(raw: Any, where: str = "value", allow_pickle: bool = False) -> Any:
    if raw is None or isinstance(raw, (bool, int, float, str)):
        return raw
    if isinstance(raw, list):
        return [decode(v, where, allow_pickle) for v in raw]
    if not isinstance(raw, dict):
        raise UnsupportedValueError(f"{where}: unexpected JSON value {type(raw).__name__}")
    if len(raw) == 1:
        (tag, body), = raw.items()
        if tag in _TAGS:
            return _decode_tag(tag, body, where, allow_pickle)
    return {k: decode(v, f"{where}.{k}", allow_pickle) for k, v in raw.items()}


def _decode_tag(tag: str, body: Any, where: str, allow_pickle: bool) -> Any:
    if tag == "__tuple__":
        return tuple(decode(v, where, allow_pickle) for v in body)
    if tag == "__dict__":
        return {_hashable(decode(k, where, allow_pickle)): decode(v, where, allow_pickle) for k, v in body}
    if tag == "__float__":
        return float(body)
    if tag == "__bytes__":
        return _unb64(body, where)
    if tag == "__dtype__":
        return dtype_from_name(body)
    if tag == "__device__":
        return torch.device(body)
    if tag == "__tensor__":
        dtype = dtype_from_name(body["dtype"])
        shape = [int(s) for s in body["shape"]]
        data = bytearray(_unb64(body["data"], where))
        if len(data) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise UnsupportedValueError(f"{where}: inline tensor data does not match shape {shape}")
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
    if tag == "__ndarray__":
        np = _numpy()
        if np is None:
            raise UnsupportedValueError(f"{where}: numpy array in checkpoint but numpy is not installed")
        dt = np.dtype(body["dtype"])
        if dt.kind not in "biufc":
            raise UnsupportedValueError(f"{where}: numpy dtype {dt} refused (object arrays could run code)")
        return np.frombuffer(_unb64(body["data"], where), dtype=dt).reshape(body["shape"]).copy()
    if tag == "__pickle__":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{where}: the checkpoint holds a pickled value; unpickling can run arbitrary code. If you "
                "trust this checkpoint, load it with allow_pickle=True")
        return pickle.loads(_unb64(body, where))  # opt-in only: allow_pickle=True on load
    raise AssertionError(tag)


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


def record(cls: type) -> type:
    """Register frozen dataclass `cls` as a record that `to_wire` / `from_wire` carry between ranks.

    Wire form: {"record": <class name>, "fields": [<field values in order>]}. Field values are JSON
    values or records (alone or in a list); a list comes back as a tuple (one level: deeper lists
    stay lists, which keeps large plans cheap to decode).
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
    """The record `raw` encodes; MetadataError if it is not one of the `expected` classes."""
    if not (_is_wire_record(raw) and raw["record"] in _RECORDS):
        raise MetadataError(f"expected a bcp record, got {str(raw)[:120]}")
    cls = _RECORDS[raw["record"]]
    if expected is not None and not issubclass(cls, expected):
        names = [c.__name__ for c in (expected if isinstance(expected, tuple) else (expected,))]
        raise MetadataError(f"expected a record of type {' or '.join(names)}, got {cls.__name__}")
    values = raw["fields"]
    if type(values) is not list or len(values) != len(_FIELDS[cls]):
        raise MetadataError(f"record {cls.__name__}: expected {len(_FIELDS[cls])} fields, got {values!r:.120}")
    out = []
    for v in values:
        if type(v) is dict:
            if _is_wire_record(v):
                v = from_wire(v)
        elif type(v) is list:
            v = tuple(from_wire(x) for x in v) if v and _is_wire_record(v[0]) else tuple(v)
        out.append(v)
    return cls(*out)
