"""Typed values (spec/container.md §5.4, §5.5; R-018) through every route a checkpoint takes.

The routes: ``ckptkit.save``/``load``; DCP with ``ckptkit.distributed.Writer``/``Reader``
(raw ``dcp.save``/``dcp.load``) and the short forms ``ckptkit.distributed.save``/``load``;
the Lightning plug-in's ``save_checkpoint``/``load_checkpoint``. The promise checked: a
value comes back equal and of the same type, or it is refused at save, naming its key path
and what to store instead. Nothing in between: no value is changed on the way back.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import io
import pathlib
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import ROOT, bits, examples, fixture_generator, load_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch.distributed.checkpoint.api import CheckpointException

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.errors import MalformedIndex, UnsupportedValue, UnsupportedVersion
from ckptkit.format import _values as values
from ckptkit.format._section import _pack_tree, check_plain
from ckptkit.format._values import DEVICE_TYPES, NUMPY_DTYPES, TORCH_DTYPES, TypedValue, decode_leaf, encode_torch
from ckptkit.integrations.lightning import CheckpointIO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def same(a: Any, b: Any) -> bool:
    """Equal and of the same type, all the way down (arrays by dtype, shape and bytes; floats by bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, (np.ndarray, np.generic)):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        keys_match = list(a) == list(b) if isinstance(a, collections.OrderedDict) else a.keys() == b.keys()
        return keys_match and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# ---------------------------------------------------------------------------- the four routes


def via_container(value: Any, tmp: Path) -> Callable[[], Any]:
    ckptkit.save(tmp / "c.ckpt", ckptkit.Checkpoint(step=1, monitor={"v": value}))
    return lambda: ckptkit.load(tmp / "c.ckpt").monitor["v"]


def via_lightning(value: Any, tmp: Path) -> Callable[[], Any]:
    io_ = CheckpointIO()
    io_.save_checkpoint({"v": value, "global_step": 1}, tmp / "l.ckpt")
    return lambda: io_.load_checkpoint(tmp / "l.ckpt")["v"]


def blank(value: Any) -> Any:
    """The destination DCP loads into: the same containers where DCP recurses, None for each leaf it stores."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):  # DCP recurses into any Mapping, a defaultdict too: the destination's type stays
        out = copy.copy(value)
        out.update((k, blank(v)) for k, v in value.items())
        return out
    if _recursed(value):
        return [blank(v) for v in value]
    return None


def _recursed(v: Any) -> bool:
    """DCP's ``_is_terminal``, negated: it recurses into maps, and into lists holding a tensor, a map or such a list."""
    return isinstance(v, dict) or (isinstance(v, list) and any(_recursed(x) or isinstance(x, torch.Tensor) for x in v))


def via_dcp(value: Any, tmp: Path) -> Callable[[], Any]:
    writer = ckd.Writer(tmp / "raw")
    try:
        dcp.save({"v": value}, storage_writer=writer)
    except CheckpointException:
        assert writer.failure is not None
        raise writer.failure from None

    def load() -> Any:
        dest = {"v": blank(value)}
        dcp.load(dest, storage_reader=ckd.Reader(tmp / "raw"), planner=ckd.LoadPlanner())
        return dest["v"]

    return load


def via_short_forms(value: Any, tmp: Path) -> Callable[[], Any]:
    ckd.save({"v": value}, tmp / "short")

    def load() -> Any:
        dest = {"v": blank(value)}
        ckd.load(dest, tmp / "short")
        return dest["v"]

    return load


#: route -> save(value, directory), which returns the load.
ROUTES: dict[str, Callable[[Any, Path], Callable[[], Any]]] = {
    "container": via_container,
    "dcp": via_dcp,
    "short_forms": via_short_forms,
    "lightning": via_lightning,
}


def round_trip(route: str, value: Any, tmp: Path) -> Any:
    return ROUTES[route](value, tmp)()


# ---------------------------------------------------------------------------- round trips


def _rng_states() -> dict[str, Any]:
    rs = np.random.RandomState(3)
    rs.standard_normal()  # a cached gaussian: the state's last two fields are set
    return {"numpy": rs.get_state(), "python": random.Random(3).getstate()}


VALUES: dict[str, Any] = {
    "numpy_rng_state": np.random.get_state(),
    "numpy_rng_state_with_gaussian": _rng_states()["numpy"],
    "python_rng_state": _rng_states()["python"],
    "ndarray_int64": np.arange(6, dtype=np.int64).reshape(2, 3),
    "ndarray_big_endian": np.arange(4, dtype=">f8"),
    "ndarray_0d_bool": np.array(True),
    "ndarray_fortran_order": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "int64": np.int64(-5),
    "float64": np.float64(0.1),
    "float32": np.float32(2.5),
    "bool_": np.bool_(False),
    "uint64": np.uint64(2**64 - 1),
    "dtype": torch.bfloat16,
    "device": torch.device("cuda", 1),
    "size": torch.Size([2, 3]),
    "set": {1, "a", (2, None)},
    "frozenset": frozenset({b"x", 3}),
    "ordered_dict": collections.OrderedDict([("z", 1), ("a", 2), (0, [np.int8(1)])]),
    "int_keys": {0: "a", 1: "b"},
    "nested": {"epoch": 3, "seen": {4, 5}, "rng": [np.random.get_state()], "dtypes": (torch.float16, np.float16(1))},
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_typed_value_comes_back_equal_and_of_the_same_type(route: str, name: str, tmp_path: Path) -> None:
    back = round_trip(route, VALUES[name], tmp_path)
    assert same(back, VALUES[name]), (back, VALUES[name])


def test_the_numpy_rng_state_comes_back_as_the_object_set_state_accepts(tmp_path: Path) -> None:
    rs = np.random.RandomState(7)
    rs.standard_normal(3)
    state = rs.get_state()
    back = round_trip("container", state, tmp_path)
    later = rs.standard_normal(5)
    rs.set_state(back)
    assert rs.standard_normal(5).tobytes() == later.tobytes()


def test_a_numpy_array_loads_writable_in_its_own_memory(tmp_path: Path) -> None:
    back = round_trip("container", np.arange(3, dtype=">i4"), tmp_path)
    back[0] = 9
    assert back.flags.writeable and back.flags.owndata and back.dtype == np.dtype(">i4") and back.tolist() == [9, 1, 2]


def test_a_module_state_dict_comes_back_an_ordered_dict_in_its_own_order(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    ckptkit.save(tmp_path / "m.ckpt", ckptkit.Checkpoint(step=1, model=net.state_dict()))
    back = ckptkit.load(tmp_path / "m.ckpt").model
    assert type(back) is collections.OrderedDict and list(back) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    net.load_state_dict(back)


def test_typed_values_have_the_bytes_of_the_spec() -> None:
    """spec/container.md §5.4: ``[ext 4 "<name>", fields...]``; a set's elements in canonical order."""

    def packed(v: Any) -> str:
        return msgpack.packb(_pack_tree(check_plain(v, "v")), use_bin_type=True).hex(" ")

    assert (
        packed(np.int64(-3))
        == "93 c7 0c 04 6e 75 6d 70 79 2e 73 63 61 6c 61 72 a5 69 6e 74 36 34 c4 08 fd ff ff ff ff ff ff ff"
    )
    assert packed(np.arange(2, dtype=">i2")) == (
        "95 c7 0d 04 6e 75 6d 70 79 2e 6e 64 61 72 72 61 79 a5 69 6e 74 31 36 91 02 c4 04 00 00 01 00 c3"
    )
    assert packed({"a", 3}) == packed({3, "a"}) == "93 c7 03 04 73 65 74 03 a1 61"
    assert packed(torch.float16) == "92 c7 0b 04 74 6f 72 63 68 2e 64 74 79 70 65 a7 66 6c 6f 61 74 31 36"


def _typed_file(tmp_path: Path, value: TypedValue) -> Path:
    ckptkit.save(tmp_path / "d.ckpt", ckptkit.Checkpoint(step=1, monitor={"v": value}))
    return tmp_path / "d.ckpt"


def test_a_dtype_name_outside_the_table_is_refused_by_load_and_verify_alike(tmp_path: Path) -> None:
    path = _typed_file(tmp_path, TypedValue("torch.dtype", ("float99",)))
    with pytest.raises(UnsupportedVersion) as e:
        ckptkit.load(path)
    assert str(e.value) == (
        f"{path}: offset 64 (0x40): monitor index: torch.dtype 'float99' is not a dtype name of spec/container.md "
        "§5.4 (an alias such as 'float' is not one); written by a newer ckptkit? upgrade ckptkit to read it; nothing "
        "was loaded (R-033)"
    )
    assert str(ckptkit.verify(path).error) == str(e.value)


def test_a_dtype_of_the_table_this_torch_lacks_is_refused_at_load_naming_torch(tmp_path, monkeypatch) -> None:
    path = _typed_file(tmp_path, TypedValue("torch.dtype", ("uint7",)))
    monkeypatch.delattr(torch, "uint7")
    with pytest.raises(UnsupportedVersion) as e:
        ckptkit.load(path)
    assert str(e.value) == (
        f"typed value: torch.dtype 'uint7' is not a dtype of torch {torch.__version__}; written with a newer torch? "
        "upgrade torch to read it (R-033)"
    )


def test_the_dtype_table_is_exactly_the_dtypes_of_this_torch() -> None:
    assert sorted(TORCH_DTYPES) == sorted(
        {str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    )
    for name in TORCH_DTYPES:
        dtype = getattr(torch, name)
        assert encode_torch(dtype, "v") == TypedValue("torch.dtype", (name,))


@pytest.mark.parametrize(
    ("dtype", "shape", "fits"),
    [
        ("uint8", [0, 2**63 - 1], True),
        ("uint8", [0, 2**63], False),
        ("float32", [0, 2**61 - 1], True),
        ("float32", [0, 2**61], False),
        ("float64", [2**62, 2**62, 0], False),
        ("bool", [0] * 64, True),
    ],
)
def test_an_empty_ndarray_shape_is_bounded_by_what_numpy_can_hold(dtype: str, shape: list[int], fits: bool) -> None:
    """R-030, boundary +-1: the product of the dimensions (0 as 1) times the item size below 2**63."""
    if fits:
        assert decode_leaf("numpy.ndarray", [dtype, shape, b"", False]).shape == tuple(shape)
        return
    with pytest.raises(MalformedIndex, match=r"is more than numpy can hold .*\(R-030\)$"):
        decode_leaf("numpy.ndarray", [dtype, shape, b"", False])


def test_a_torch_size_dimension_is_below_2_pow_63() -> None:
    """R-031, boundary +-1."""
    assert decode_leaf("torch.Size", [2**63 - 1]) == TypedValue("torch.Size", (2**63 - 1,))
    with pytest.raises(MalformedIndex, match=r"^torch.Size: dimension 9223372036854775808 is not below 2\*\*63"):
        decode_leaf("torch.Size", [0, 2**63])


def test_a_device_of_a_renamed_backend_is_refused_at_save(monkeypatch) -> None:
    monkeypatch.setattr(values, "DEVICE_TYPES", tuple(n for n in DEVICE_TYPES if n != "meta"))
    with pytest.raises(UnsupportedValue) as e:
        check_plain({"d": torch.device("meta", 3)}, "monitor")
    assert str(e.value).startswith("monitor['d']: torch device meta:3 cannot be stored as a value (device types: cpu, ")
    assert str(e.value).endswith("spec/container.md §5.4); store str(device) instead")


def test_a_torch_dtype_outside_the_table_is_refused_at_save(monkeypatch) -> None:
    monkeypatch.setattr(values, "TORCH_DTYPES", tuple(n for n in TORCH_DTYPES if n != "uint7"))
    with pytest.raises(UnsupportedValue) as e:
        check_plain({"d": getattr(torch, "uint7")}, "monitor")  # noqa: B009 - torch's stubs lack uint7
    known = len(TORCH_DTYPES) - 1
    assert str(e.value) == (
        f"monitor['d']: torch dtype torch.uint7 cannot be stored as a value (this ckptkit knows {known} dtypes, "
        "spec/container.md §5.4); store str(dtype) instead"
    )


@pytest.mark.parametrize("name", ["float128", "Tensor", "__class__", "save", "torch.float32", "float", "half", "long"])
def test_a_dtype_name_torch_would_resolve_or_not_is_refused_unless_listed(tmp_path: Path, name: str) -> None:
    path = _typed_file(tmp_path, TypedValue("torch.dtype", (name,)))
    with pytest.raises(UnsupportedVersion, match=r"\(R-033\)$") as e:
        ckptkit.load(path)
    assert str(ckptkit.verify(path).error) == str(e.value)


@pytest.mark.parametrize(
    ("elements", "rule"),
    [
        (((2, 3), TypedValue("torch.Size", (2, 3))), "R-032"),
        ((((2, 3), 1), (TypedValue("torch.Size", (2, 3)), 1)), "R-032"),
        ((frozenset({(1,)}), frozenset({TypedValue("torch.Size", (1,))})), "R-032"),
        ((1, 1.0), "R-018"),
    ],
)
def test_set_elements_that_are_one_value_once_loaded_are_refused(tmp_path: Path, elements: Any, rule: str) -> None:
    path = _typed_file(tmp_path, TypedValue("set", elements))
    with pytest.raises(MalformedIndex, match=rf"\({rule}\)$") as e:
        ckptkit.load(path)
    assert str(ckptkit.verify(path).error) == str(e.value)


def test_a_set_of_a_size_and_another_tuple_loads_both(tmp_path: Path) -> None:
    path = _typed_file(tmp_path, TypedValue("set", ((2, 3), TypedValue("torch.Size", (3, 2)))))
    assert ckptkit.load(path).monitor["v"] == {(2, 3), torch.Size([3, 2])}


@pytest.mark.filterwarnings("ignore:'mkldnn' is no longer used:UserWarning")
def test_every_device_string_of_the_grammar_is_one_torch_reads_back_unchanged(tmp_path: Path) -> None:
    for kind in DEVICE_TYPES:
        for text in (kind, f"{kind}:0", f"{kind}:127"):
            assert str(torch.device(text)) == text
            assert decode_leaf("torch.device", [text]) == TypedValue("torch.device", (text,))
    for text in ("cpu:128", "cuda:007", "cuda:+1", "cuda:", "CPU", "cpu\0", "cuda:\u0661", "tpu:x"):
        with pytest.raises(MalformedIndex, match=r"\(R-034\)$"):
            decode_leaf("torch.device", [text])


# ---------------------------------------------------------------------------- refusals


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1


class Pair(NamedTuple):
    a: int
    b: int


_DTYPES = ", ".join(NUMPY_DTYPES)
_PLAIN = (
    "only tensors, None, bool, int, float, str, bytes, lists, tuples, dicts, sets, ordered dicts, numpy arrays and "
    "scalars, torch dtypes, devices and sizes"
)
REFUSED: dict[str, tuple[Any, str]] = {
    "enum": (
        Color.RED,
        (
            "a test_typed_values.Color cannot be stored: an Enum member; store its .value (or .name) and rebuild the "
            "member with Color(value) on load"
        ),
    ),
    "int_enum": (
        Level.LOW,
        (
            "a test_typed_values.Level cannot be stored: an Enum member; store its .value (or .name) and rebuild the "
            "member with Level(value) on load"
        ),
    ),
    "dataclass": (
        Cfg(),
        (
            "a test_typed_values.Cfg cannot be stored: a dataclass; store dataclasses.asdict(value) and rebuild it "
            "with Cfg(**d) on load"
        ),
    ),
    "namedtuple": (
        Pair(1, 2),
        "a test_typed_values.Pair cannot be stored: a namedtuple; store value._asdict() and rebuild it with Pair(**d)",
    ),
    "path": (
        pathlib.Path("a/b"),
        "a pathlib.PosixPath cannot be stored: a path; store str(path) and rebuild it with pathlib.Path(text) on load",
    ),
    "bytes_io": (
        io.BytesIO(b"x"),
        (
            "a _io.BytesIO cannot be stored: an in-memory file; store buf.getvalue() (bytes) and rebuild it with "
            "io.BytesIO(data) on load"
        ),
    ),
    "defaultdict": (
        collections.defaultdict(int),
        (
            "a collections.defaultdict cannot be stored: a subclass of dict, which would load as a plain dict; store "
            "dict(value)"
        ),
    ),
    "numpy_str": (
        np.str_("x"),
        (
            f"a numpy scalar of dtype <U1 cannot be stored (numpy dtypes: {_DTYPES}); convert it with .astype(...), or "
            ".tolist() for plain values"
        ),
    ),
    "str_subclass": (
        type("Name", (str,), {})("x"),
        (
            "a test_typed_values.Name cannot be stored: a subclass of str, which would load as a plain str; store "
            "str(value)"
        ),
    ),
    "object_array": (
        np.array([None]),
        (
            f"a numpy array of dtype object cannot be stored (numpy dtypes: {_DTYPES}); convert it with .astype(...), "
            "or .tolist() for plain values"
        ),
    ),
    "set_of_tensors": ({torch.ones(1)}, "a set holding a tensor cannot be stored; use a list"),
    "module": (
        torch.nn.ReLU(),
        f"a torch.nn.modules.activation.ReLU cannot be stored ({_PLAIN}); convert it to one of those",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_value_that_would_need_its_class_is_refused_at_save_with_the_conversion(name: str, tmp_path: Path) -> None:
    value, why = REFUSED[name]
    with pytest.raises(UnsupportedValue) as e:
        ckptkit.save(tmp_path / "r.ckpt", ckptkit.Checkpoint(step=1, monitor={"cfg": {"x": value}}))
    assert str(e.value) == f"monitor['cfg']['x']: {why}"
    assert not (tmp_path / "r.ckpt").exists()


@pytest.mark.parametrize("route", ["dcp", "short_forms", "lightning"])
def test_every_route_refuses_at_save(route: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValue, match=r"an Enum member; store its \.value"):
        ROUTES[route](Color.RED, tmp_path)  # the save: no load is attempted


def test_an_omegaconf_container_is_refused_with_to_container() -> None:
    """omegaconf is not installed: a class of that module name stands for its DictConfig (the refusal
    reads only the type's module, never imports it)."""
    fake = type("DictConfig", (), {"__module__": "omegaconf.dictconfig"})()
    with pytest.raises(UnsupportedValue) as e:
        check_plain({"cfg": fake}, "hparams")
    assert str(e.value) == (
        "hparams['cfg']: a omegaconf.dictconfig.DictConfig cannot be stored: store "
        "OmegaConf.to_container(cfg, resolve=True) (plain containers)"
    )


# ---------------------------------------------------------------------------- DCP's int keys


@pytest.mark.parametrize("route", ["dcp", "short_forms"])
def test_dcp_int_keys_come_back_as_the_same_keys(route: str, tmp_path: Path) -> None:
    """DCP flattens ``{0: "a"}`` to the key ``"v.0"``; its default ``set_element`` then adds ``"0"``
    beside the destination's ``0`` (``{0: None, '0': 'a'}``): the Reader matches the destination's keys."""
    value = {"opt": {0: "a", 1: {"lr": 0.1}}, "n": {2: 3}}
    back = round_trip(route, value, tmp_path)
    assert back == value and all(type(k) is int for k in back["opt"])


def test_dcp_refuses_a_destination_holding_k_and_str_k(tmp_path: Path) -> None:
    ckd.save({"v": {"0": 1}}, tmp_path / "k")
    with pytest.raises(ckptkit.errors.StateMismatch, match=r"v\.0: the destination dict holds the keys \['0', 0\]"):
        ckd.load({"v": {"0": None, 0: None}}, tmp_path / "k")


# ---------------------------------------------------------------------------- the property


_KEYS = st.one_of(st.text("abc", min_size=1, max_size=3), st.integers(0, 5))
_HASHABLE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=3), st.binary(max_size=3)),
    lambda inner: st.tuples(inner, inner),
    max_leaves=4,
)
_NUMPY = st.one_of(
    hnp.arrays(
        st.sampled_from([np.dtype(n) for n in NUMPY_DTYPES] + [np.dtype(">i4"), np.dtype(">f8")]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    ),
    hnp.arrays(st.sampled_from([np.dtype(n) for n in NUMPY_DTYPES]), ()).map(lambda a: a[()]),
)
_REFUSED = st.sampled_from([Color.RED, Level.LOW, Cfg(), Pair(1, 2), pathlib.Path("p"), np.str_("s")])
_LEAVES = st.one_of(
    _HASHABLE,
    st.floats(),
    _NUMPY,
    st.sampled_from([torch.float32, torch.bfloat16, torch.device("cpu"), torch.device("cuda", 0), torch.Size([1, 2])]),
    st.sets(_HASHABLE, max_size=3),
    st.frozensets(_HASHABLE, max_size=3),
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 3)),
    _REFUSED,
)
_TREES: st.SearchStrategy[Any] = st.recursive(
    st.one_of(_LEAVES, st.just(collections.defaultdict(int))),  # a Mapping DCP recurses into, so not in _DCP_TREES
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=3),
        st.dictionaries(_KEYS, inner, max_size=3).map(lambda d: collections.OrderedDict(reversed(d.items()))),
    ),
    max_leaves=8,
)
# Through DCP, maps (and lists holding maps) are the destination's structure, not stored values: DCP
# recurses into them and stores the leaves. Lists and tuples of leaves are stored values.
_DCP_TREES: st.SearchStrategy[Any] = st.recursive(
    st.one_of(_LEAVES, st.lists(_LEAVES, max_size=3), st.lists(_LEAVES, max_size=3).map(tuple)),
    lambda inner: st.one_of(
        st.dictionaries(_KEYS, inner, max_size=3),
        st.dictionaries(_KEYS, inner, max_size=3).map(lambda d: collections.OrderedDict(reversed(d.items()))),
    ),
    max_leaves=8,
)


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_value_comes_back_equal_and_same_type_or_is_refused_at_save(route: str, tmp_path_factory: Any) -> None:
    @settings(max_examples=examples(1), suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(value=_DCP_TREES if route in ("dcp", "short_forms") else _TREES)
    def check(value: Any) -> None:
        tmp = tmp_path_factory.mktemp(route)
        original = copy.deepcopy(value)
        try:
            load = ROUTES[route](value, tmp)
        except UnsupportedValue:
            return  # refused at save: the promise's other half
        back = load()
        assert same(back, original), (back, original)

    check()


def test_inspect_json_shows_typed_values_without_their_data(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ckptkit.cli import main

    assert main(["inspect", "fixtures/valid/v2-typed-values.ckpt", "--json"]) == 0
    monitor = json.loads(capsys.readouterr().out)["monitor"]
    assert monitor["numpy"]["big_endian_int32"] == "<numpy.ndarray >i4[3]>"
    assert monitor["numpy"]["scalar_int64"] == "<numpy.int64 <i8[]>"
    assert monitor["torch"] == {
        "device": "<torch.device cuda:1>",
        "dtype": "<torch.dtype bfloat16>",
        "size": "<torch.Size 2, 3>",
    }
    assert monitor["set"] == ["a", 3, [1, 2], None] and monitor["frozenset"] == ["78", 2.5]


def test_state_digests_and_comparisons_take_typed_values() -> None:
    """The one tree walk (format/_tree.py) digests a typed value by its canonical bytes, and ``ckptkit diff``'s
    comparison compares numpy values by dtype, shape and bytes: equal states agree, a changed one differs."""
    from ckptkit.audit._compare import compare_states
    from ckptkit.format._tree import flatten, tree_digest

    a = {"rng": np.random.RandomState(1).get_state(), "seen": {3, 1}, "dtype": torch.float16, "n": np.int64(2)}
    same_state = {"rng": np.random.RandomState(1).get_state(), "seen": {1, 3}, "dtype": torch.float16, "n": np.int64(2)}
    other = {**a, "rng": np.random.RandomState(2).get_state(), "n": np.int32(2)}
    assert tree_digest(a, "v") == tree_digest(same_state, "v") != tree_digest(other, "v")
    assert compare_states(flatten(a, "monitor"), flatten(same_state, "monitor")) == []
    changed = compare_states(flatten(a, "monitor"), flatten(other, "monitor"))
    assert [d.name for d in changed] == ["monitor:n", "monitor:rng.1"]  # the int32 scalar; the key array


def test_the_golden_files_hold_typed_values_that_load_as_the_generator_made_them() -> None:
    """``fixtures/valid/v2-typed-values.ckpt`` and ``fixtures/distributed/typed-values`` (their bytes are
    pinned by the fixture tests) load as the very values and types their generators wrote."""
    want = fixture_generator().typed_state()
    assert same(ckptkit.load(ROOT / "fixtures" / "valid" / "v2-typed-values.ckpt").monitor, want)
    dist = load_script("generate_distributed", ROOT / "fixtures" / "generate_distributed.py").typed_state()
    dest = blank(dist)
    ckd.load(dest, ROOT / "fixtures" / "distributed" / "typed-values")
    assert same(dest, dist)


def test_a_copy_of_a_state_keeps_its_ordered_dicts() -> None:
    """``format.tree.clone`` (the guard's ring, RunState's copies) keeps an OrderedDict's type and order."""
    from ckptkit.format._tree import clone

    state = {"m": collections.OrderedDict([("b", torch.ones(1)), ("a", 1)])}
    copied = clone(state)
    assert type(copied["m"]) is collections.OrderedDict and list(copied["m"]) == ["b", "a"]
    assert copied["m"]["b"] is not state["m"]["b"] and same(copied, state)
