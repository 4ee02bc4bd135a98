"""Typed values: the numpy, torch and collection values a trainer keeps beside its tensors.

A typed value is stored in a tree as a msgpack array whose first element is the
extension type :data:`EXT_TYPED` with the type's name as payload (``numpy.ndarray``),
followed by the type's fields, each itself a tree value (``spec/container.md`` §5.4,
rules R-018). The name is one of a closed table, :data:`TYPE_NAMES`: a reader maps it
to code it already has and never imports a module or class a file names; a name it
does not know is refused by name (``UnsupportedVersion``), never guessed at.

This module is torch-free, and numpy is only looked at when a numpy value is met
(encoding: numpy is then already imported; decoding: imported lazily). Sets, frozensets
and ordered dicts are containers and are walked by :mod:`ckptkit.format._section`;
``torch.dtype``, ``torch.device`` and ``torch.Size`` are encoded by the tensor codec,
where torch is imported, and stay :class:`TypedValue` objects in a tree decoded here
until the codec turns them back into torch objects.

Values that would need a class named by the file to come back (Enums, dataclasses,
namedtuples, paths, subclasses of the plain types) are refused at save with the
conversion to make (:func:`refusal`).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import math
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import MalformedIndex, UnsupportedValue, UnsupportedVersion

__all__ = [
    "CONTAINER_TYPES",
    "EXT_TYPED",
    "DEVICE_TYPES",
    "NUMPY_DTYPES",
    "TORCH_DTYPES",
    "TORCH_TYPES",
    "TYPE_NAMES",
    "TypedValue",
    "decode_leaf",
    "encode_numpy",
    "encode_torch",
    "is_device_string",
    "loaded_key",
    "refusal",
]

#: The msgpack extension type of a typed value's marker (payload: its name, UTF-8).
#: 1 is the tensor reference, 2 the tuple marker; 3 stays unassigned (the fixture
#: ``R-016-unknown-ext-type-3.ckpt`` keeps proving that an unknown code is refused).
EXT_TYPED = 4
#: Typed values whose fields are elements (sets) or key/value pairs (ordered dicts).
CONTAINER_TYPES = ("collections.OrderedDict", "frozenset", "set")
#: Typed values decoded by the tensor codec, where torch is imported.
TORCH_TYPES = ("torch.Size", "torch.device", "torch.dtype")
#: Every name a reader of this version knows.
TYPE_NAMES = tuple(sorted((*CONTAINER_TYPES, "numpy.ndarray", "numpy.scalar", *TORCH_TYPES)))
#: numpy dtypes stored as typed values: the dtype table's names (section.DTYPE_SIZES) numpy has.
NUMPY_DTYPES: tuple[str, ...] = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
)
NUMPY_DTYPES += ("float32", "float64", "complex64", "complex128")  # no bfloat16, no float8 in numpy
_MAX_NDIM = 64  # numpy's own limit (NPY_MAXDIMS), and the tensor table's
_INT64_END = 2**63  # numpy sizes, torch sizes and element counts are int64
#: Names a ``torch.dtype`` value is stored under (R-033): ``str(dtype)`` without ``torch.``, one
#: name per dtype (torch's aliases, ``float`` for ``float32``, are not names: one value, one byte string).
TORCH_DTYPES: tuple[str, ...] = (
    *("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"),
    *("float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128"),
    *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"),
    *("qint8", "qint32", "quint8", "quint2x4", "quint4x2"),
    *("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
    *(f"int{n}" for n in range(1, 8)),
    *(f"uint{n}" for n in range(1, 8)),
)
#: Device types of a ``torch.device`` value (R-034): the ones torch's device-string parser knows.
DEVICE_TYPES: tuple[str, ...] = (
    *("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia"),
    *("xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"),
)
_MAX_DEVICE_INDEX = 127  # torch's DeviceIndex is an int8: "cpu:128" would come back as cpu:-128


@dataclass(frozen=True)
class TypedValue:
    """A typed value as the tree holds it: its name from :data:`TYPE_NAMES` and its fields."""

    name: str
    fields: tuple[Any, ...]


def _bad(problem: str) -> MalformedIndex:
    """Fields that do not fit their type; the section reader adds where (path, offset, field)."""
    return MalformedIndex(problem, hint="R-018")


# ---------------------------------------------------------------------------- writing


def encode_numpy(value: Any, where: str) -> TypedValue | None:
    """The typed value of a numpy array or scalar; None when ``value`` is not one.

    Raises:
        UnsupportedValue: a numpy value of a dtype not in :data:`NUMPY_DTYPES`, or a subclass.
    """
    np = sys.modules.get("numpy")
    if np is None or type(value).__module__ != "numpy" or not isinstance(value, (np.ndarray, np.generic)):
        return None  # no numpy imported: the value cannot be a numpy value
    dtype = value.dtype
    if dtype.name not in NUMPY_DTYPES or dtype.fields is not None:
        raise UnsupportedValue(
            f"{where}: a numpy {'array' if isinstance(value, np.ndarray) else 'scalar'} of dtype {dtype} cannot be "
            f"stored (numpy dtypes: {', '.join(NUMPY_DTYPES)}); convert it with .astype(...), or .tolist() for "
            "plain values"
        )
    little = np.dtype(dtype.name).newbyteorder("<")
    data = np.ascontiguousarray(value, dtype=little).tobytes()
    if isinstance(value, np.ndarray):
        return TypedValue("numpy.ndarray", (dtype.name, list(value.shape), data, dtype.byteorder == ">"))
    return TypedValue("numpy.scalar", (dtype.name, data))


def encode_torch(value: Any, where: str) -> TypedValue | None:
    """The typed value of a ``torch.dtype``, ``torch.device`` or ``torch.Size``; None when ``value`` is not one.

    Torch is not imported here: when it is not already imported, the value is no torch value.

    Raises:
        UnsupportedValue: a dtype not in :data:`TORCH_DTYPES` (a torch newer than this table).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    t = type(value)
    if t is torch.dtype:
        name = str(value).removeprefix("torch.")
        if name not in TORCH_DTYPES:
            raise UnsupportedValue(
                f"{where}: torch dtype {value} cannot be stored as a value (this ckptkit knows {len(TORCH_DTYPES)} "
                "dtypes, spec/container.md §5.4); store str(dtype) instead"
            )
        return TypedValue("torch.dtype", (name,))
    if t is torch.device:
        if not is_device_string(str(value)):  # a renamed privateuse1 backend ("npu:0"): no reader would take it
            raise UnsupportedValue(
                f"{where}: torch device {value} cannot be stored as a value (device types: {', '.join(DEVICE_TYPES)}, "
                "spec/container.md §5.4); store str(device) instead"
            )
        return TypedValue("torch.device", (str(value),))
    if t is torch.Size:
        return TypedValue("torch.Size", tuple(int(d) for d in value))
    return None


#: What :func:`refusal` says of a tensor where only plain values go (a caller may add its own route).
NO_TENSORS = "which holds no tensors"

_ADVICE: tuple[tuple[type, str], ...] = (
    (argparse.Namespace, "an argparse Namespace; store vars(ns) (a dict) and rebuild it with argparse.Namespace(**d)"),
    (enum.Enum, "an Enum member; store its .value (or .name) and rebuild the member with {cls}(value) on load"),
    (pathlib.PurePath, "a path; store str(path) and rebuild it with pathlib.Path(text) on load"),
    (io.BytesIO, "an in-memory file; store buf.getvalue() (bytes) and rebuild it with io.BytesIO(data) on load"),
)


def refusal(value: Any, where: str, *, tensors: bool = True) -> str:
    """Why ``value`` cannot be stored, and the conversion to make, as an error message.

    Nothing here imports the value's class by name: a value that would need its class
    (or a module) to come back is refused with what to store instead. ``tensors``: whether
    the place asked about carries tensors (a section does; a plain value, such as an
    ``add_value`` value or a distributed run's replicated state, does not).
    """
    t = type(value)
    name = f"{t.__module__}.{t.__qualname__}"
    cls = t.__qualname__
    if not tensors and _is_tensor(value):
        return (
            f"{where}: a {name} cannot be stored here: this is a plain value (None, bool, int, float, str, bytes, "
            f"lists, tuples, dicts, sets, numpy arrays and scalars), {NO_TENSORS}; store value.tolist()"
        )
    for base, advice in _ADVICE:
        if isinstance(value, base):
            return f"{where}: a {name} cannot be stored: {advice.format(cls=cls)}"
    if dataclasses.is_dataclass(value):
        return (
            f"{where}: a {name} cannot be stored: a dataclass; store dataclasses.asdict(value) and rebuild it with "
            f"{cls}(**d) on load"
        )
    if t.__module__.partition(".")[0] == "omegaconf":
        return f"{where}: a {name} cannot be stored: store OmegaConf.to_container(cfg, resolve=True) (plain containers)"
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"{where}: a {name} cannot be stored: a namedtuple; store value._asdict() and rebuild it with {cls}(**d)"
    for base in (bool, int, float, str, bytes, tuple, list, dict):
        if isinstance(value, base):
            plain = base.__name__
            return (
                f"{where}: a {name} cannot be stored: a subclass of {plain}, which would load as a plain {plain}; "
                f"store {plain}(value)"
            )
    kinds = "tensors, None" if tensors else "None"
    return (
        f"{where}: a {name} cannot be stored (only {kinds}, bool, int, float, str, bytes, lists, tuples, "
        "dicts, sets, ordered dicts, numpy arrays and scalars, torch dtypes, devices and sizes); convert it to one "
        "of those"
    )


def _is_tensor(value: Any) -> bool:
    """A ``torch.Tensor`` (or subclass), told without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# ---------------------------------------------------------------------------- reading


def decode_leaf(name: str, fields: list[Any]) -> Any:
    """The value of a typed value that is not a container (R-018).

    numpy values come back as numpy objects; torch types as :class:`TypedValue`, checked
    here and turned into torch objects by the codec.

    Raises:
        UnsupportedVersion: a name not in :data:`TYPE_NAMES` (R-018).
        MalformedIndex: fields that do not fit the type (R-018).
    """
    if name == "numpy.ndarray":
        return _ndarray(fields)
    if name == "numpy.scalar":
        return _scalar(fields)
    if name == "torch.Size":
        if not all(type(d) is int and d >= 0 for d in fields):
            raise _bad("torch.Size: fields must be non-negative integers")
        if any(d >= _INT64_END for d in fields):
            raise MalformedIndex(
                f"torch.Size: dimension {max(fields)} is not below 2**63 (a torch size is int64)",
                hint="R-031",
            )
        return TypedValue(name, tuple(fields))
    if name in ("torch.device", "torch.dtype"):
        if len(fields) != 1 or not isinstance(fields[0], str) or not 0 < len(fields[0]) <= 64:
            raise _bad(f"{name}: must have one field, a string of 1..64 characters")
        (_dtype_name if name == "torch.dtype" else _device)(fields[0])
        return TypedValue(name, tuple(fields))
    raise UnsupportedVersion(
        f"unknown value type {name[:60]!r} (this reader knows {', '.join(TYPE_NAMES)})",
        hint="written by a newer ckptkit? upgrade ckptkit to read it; nothing was loaded (R-018)",
    )


def _dtype_name(text: str) -> None:
    """A ``torch.dtype`` field: a name of :data:`TORCH_DTYPES`, exactly (R-033)."""
    if text not in TORCH_DTYPES:
        raise UnsupportedVersion(
            f"torch.dtype {text[:40]!r} is not a dtype name of spec/container.md §5.4 (an alias such as 'float' is "
            "not one)",
            hint="written by a newer ckptkit? upgrade ckptkit to read it; nothing was loaded (R-033)",
        )


def is_device_string(text: str) -> bool:
    """``<type>`` or ``<type>:<index>`` as ``str(device)`` writes it: a type of :data:`DEVICE_TYPES`,
    the index 0..127 in ASCII decimal without sign or leading zeros (R-034)."""
    kind, colon, index = text.partition(":")
    if not colon:
        return kind in DEVICE_TYPES
    canonical = index.isdecimal() and index.isascii() and str(int(index)) == index
    return kind in DEVICE_TYPES and canonical and int(index) <= _MAX_DEVICE_INDEX


def _device(text: str) -> None:
    """A ``torch.device`` field (R-034)."""
    if not is_device_string(text):
        raise MalformedIndex(
            f"torch.device {text[:40]!r} is not a device string (expected <type> or <type>:<index>, the type one of "
            f"{', '.join(DEVICE_TYPES)}, the index 0..{_MAX_DEVICE_INDEX} without leading zeros)",
            hint="R-034",
        )


def loaded_key(value: Any) -> Any:
    """What a decoded set element is equal to once loaded: a ``torch.Size`` is the tuple of its
    dimensions (``torch.Size([2, 3]) == (2, 3)``, same hash), inside tuples and frozensets too (R-032)."""
    if type(value) is TypedValue and value.name == "torch.Size":
        return value.fields
    if type(value) is tuple:
        return tuple(map(loaded_key, value))
    if type(value) is frozenset:
        return frozenset(map(loaded_key, value))
    return value


def _numpy_fields(name: str, dtype: Any, data: Any, numel: int) -> Any:
    """numpy and the little-endian numpy dtype of checked ``(dtype, data)`` fields holding ``numel`` elements."""
    if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
        raise _bad(f"{name}: unknown dtype {str(dtype)[:40]!r} (numpy dtypes: {', '.join(NUMPY_DTYPES)})")
    import numpy as np

    size = np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) != numel * size:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise _bad(f"{name}: data must be {numel} x {size} bytes (got {got})")
    if dtype == "bool" and data.strip(b"\x00\x01"):
        raise _bad(f"{name}: a bool byte other than 0 or 1")
    return np, np.dtype(dtype).newbyteorder("<")


def _ndarray(fields: list[Any]) -> Any:
    if len(fields) != 4:
        raise _bad(f"numpy.ndarray: must have 4 fields (dtype, shape, data, big_endian), got {len(fields)}")
    dtype, shape, data, big = fields
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"numpy.ndarray: shape must be at most {_MAX_NDIM} non-negative integers")
    np, little = _numpy_fields("numpy.ndarray", dtype, data, math.prod(shape))
    if math.prod(max(d, 1) for d in shape) * little.itemsize >= _INT64_END:
        raise MalformedIndex(
            f"numpy.ndarray: shape {shape} of {dtype} is more than numpy can hold (the product of the dimensions, "
            f"0 counted as 1, times the item size {little.itemsize} must be below 2**63)",
            hint="R-030",
        )
    if not isinstance(big, bool) or (big and little.itemsize == 1):
        raise _bad("numpy.ndarray: big_endian must be a bool, false for one-byte dtypes")
    out = np.frombuffer(data, dtype=little).reshape(shape)
    return out.astype(little.newbyteorder(">") if big else np.dtype(dtype))  # a copy: writable, own memory


def _scalar(fields: list[Any]) -> Any:
    if len(fields) != 2:
        raise _bad(f"numpy.scalar: must have 2 fields (dtype, data), got {len(fields)}")
    np, little = _numpy_fields("numpy.scalar", fields[0], fields[1], 1)
    return np.frombuffer(fields[1], dtype=little).astype(np.dtype(fields[0]))[0]
