"""Config snapshots, the drift check and the field-coverage invariant (spec/snapshot.md).

The ``ckptkit diff`` command is tested in test_cli_diff.py."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import keyword
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import pytest
from helpers import Flat, examples
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import (
    CheckpointNotFound,
    ConfigDrift,
    FormatError,
    UnsupportedValue,
    UnsupportedVersion,
)
from ckptkit.format._snapshot import (
    Snapshot,
    encode_snapshot,
    read_snapshot,
    snapshot_config,
    snapshot_path,
    write_snapshot,
)
from ckptkit.run._drift import DEFAULT_EXEMPT, KeyDiff, check_resume, diff_keys
from ckptkit.run._field_coverage import assert_field_coverage

# --------------------------------------------------------------------------- configs


class Act(enum.Enum):
    GELU = "gelu"
    RELU = "relu"


@dataclass(frozen=True)
class ModelCfg:
    d: int = 4  # width, >= 1
    act: Act = Act.GELU
    dropout: float | None = None  # None: no dropout


@dataclass(frozen=True)
class TrainCfg:
    lr: float = 1e-3
    steps: int = 10
    betas: tuple[float, float] = (0.9, 0.95)
    rand_depth: bool = False
    log_dir: str = field(default="runs", metadata={"snapshot": False})


@dataclass(frozen=True)
class Cfg:
    model: ModelCfg = ModelCfg()
    train: TrainCfg = TrainCfg()
    seed: int = 1


GOLDEN = b"""{
  "config": {
    "model": {
      "act": "gelu",
      "d": 4,
      "dropout": null
    },
    "seed": 1,
    "train": {
      "betas": [
        0.9,
        0.95
      ],
      "lr": 0.001,
      "rand_depth": false,
      "steps": 10
    }
  },
  "config_type": "MODULE.Cfg",
  "schema_version": 1
}
""".replace(b"MODULE", __name__.encode())


def _doc(config: object, **top: object) -> bytes:
    doc = {"schema_version": 1, "config_type": "x.Cfg", "config": config, **top}
    return json.dumps(doc).encode()


# --------------------------------------------------------------------------- format


def test_snapshot_is_byte_exact_golden_for_a_nested_config():
    assert encode_snapshot(Cfg()) == GOLDEN


def test_same_config_gives_same_bytes_whatever_the_field_order():
    a = dataclasses.make_dataclass("C", [("b", int), ("a", float)])(b=1, a=0.5)
    b = dataclasses.make_dataclass("C", [("a", float), ("b", int)])(a=0.5, b=1)
    assert encode_snapshot(a) == encode_snapshot(b)
    assert encode_snapshot(Cfg()) == encode_snapshot(Cfg())


def test_write_then_read_round_trips_every_value_exactly(tmp_path):
    floats = (0.1, 1 / 3, 5e-324, -0.0, 1.7976931348623157e308, 1e16, 2.0)
    C = dataclasses.make_dataclass("C", [("f", tuple), ("big", int), ("s", str), ("e", Act), ("n", type(None))])
    cfg = C(f=floats, big=2**80 + 1, s='h\u00e9llo \U0001f600 "q"', e=Act.RELU, n=None)
    path = tmp_path / "step-00000001.ckpt.config.json"
    write_snapshot(path, cfg)
    snap = read_snapshot(path)
    assert [math.copysign(1, x) * abs(x) for x in snap.config["f"]] == list(floats)
    assert [x.hex() for x in snap.config["f"]] == [x.hex() for x in floats]
    assert snap.config == {"f": list(floats), "big": 2**80 + 1, "s": cfg.s, "e": "relu", "n": None}
    assert snap.config_type == "types.C"
    assert snap.schema_version == 1
    assert snap.path == str(path)
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left behind
    assert path.read_bytes().isascii()
    assert check_resume(snap, cfg) == []


def test_snapshot_path_is_the_checkpoint_name_plus_config_json():
    assert snapshot_path("run/step-00000120.ckpt") == "run/step-00000120.ckpt.config.json"


def test_field_opted_out_of_the_snapshot_is_not_written():
    assert "log_dir" not in snapshot_config(Cfg())["train"]


def test_enum_is_written_as_its_value():
    assert snapshot_config(ModelCfg(act=Act.RELU)) == {"act": "relu", "d": 4, "dropout": None}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            math.inf,
            (
                "config field train.clip: cannot snapshot the non-finite float inf; "
                'JSON has no NaN or infinity; use None for "no limit"'
            ),
        ),
        (
            {"a": 1},
            (
                "config field train.clip: cannot snapshot a dict {'a': 1}; supported: bool, int, float, str, "
                "None, list, tuple, Enum or a nested dataclass (a dict becomes a nested dataclass)"
            ),
        ),
        (
            (1.0, math.nan),
            (
                "config field train.clip[1]: cannot snapshot the non-finite float nan; "
                'JSON has no NaN or infinity; use None for "no limit"'
            ),
        ),
    ],
)
def test_snapshot_refuses_unsupported_values_naming_the_field(value, message):
    Train = dataclasses.make_dataclass("Train", [("clip", object)])
    Outer = dataclasses.make_dataclass("Outer", [("train", Train)])
    with pytest.raises(UnsupportedValue) as e:
        snapshot_config(Outer(train=Train(clip=value)))
    assert str(e.value) == message


def test_snapshot_refuses_a_config_that_is_not_a_dataclass_instance():
    with pytest.raises(UnsupportedValue) as e:
        snapshot_config({"lr": 0.1})
    assert str(e.value) == "a config snapshot needs a dataclass instance (got dict)"


def test_write_snapshot_refuses_unsupported_values_and_writes_nothing(tmp_path):
    Bad = dataclasses.make_dataclass("Bad", [("lr", float)])
    with pytest.raises(UnsupportedValue):
        write_snapshot(tmp_path / "a.config.json", Bad(lr=math.nan))
    assert os.listdir(tmp_path) == []


def test_importing_snapshot_and_cli_diff_leaves_torch_unimported():
    code = "import ckptkit.format._snapshot, ckptkit.cli._diff, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- read errors


def test_read_refuses_a_missing_file(tmp_path):
    path = tmp_path / "nope.config.json"
    with pytest.raises(CheckpointNotFound) as e:
        read_snapshot(path)
    assert str(e.value) == f"{path}: no config snapshot here"


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (
            b"\xff{}",
            FormatError,
            (
                "not a config snapshot: invalid UTF-8 JSON ('utf-8' codec can't decode byte 0xff in position 0: "
                "invalid start byte); a snapshot is the <ckpt>.config.json file written next to a checkpoint"
            ),
        ),
        (
            b'{"schema_version": 1, "config_type": "x", "config": {"lr": NaN}}',
            FormatError,
            (
                "not a config snapshot: invalid UTF-8 JSON (non-finite number NaN); "
                "a snapshot is the <ckpt>.config.json file written next to a checkpoint"
            ),
        ),
        (
            b'{"schema_version": 1, "config_type": "x", "config": {"lr": 1e400}}',
            FormatError,
            (
                "not a config snapshot: invalid UTF-8 JSON (number 1e400 overflows a float); "
                "a snapshot is the <ckpt>.config.json file written next to a checkpoint"
            ),
        ),
        (
            b'{"schema_version": 1, "config_type": "x", "config": {"lr": 1, "lr": 2}}',
            FormatError,
            (
                "not a config snapshot: invalid UTF-8 JSON (duplicate key 'lr'); "
                "a snapshot is the <ckpt>.config.json file written next to a checkpoint"
            ),
        ),
        (b"[]", FormatError, "not a config snapshot: the document is not a JSON object (expected object, got list)"),
        (
            b'{"config_type": "x", "config": {}}',
            FormatError,
            "schema_version: missing or non-integer schema_version (expected integer, got null)",
        ),
        (
            _doc({}, schema_version=2),
            UnsupportedVersion,
            "schema_version: unsupported snapshot schema_version (expected 1, got 2); upgrade ckptkit to read it",
        ),
        (
            _doc({}, extra=1),
            FormatError,
            "wrong top-level keys (expected config, config_type, schema_version, got missing [], unknown ['extra'])",
        ),
        (
            _doc([]),
            FormatError,
            "config: config is not a table (expected object, got list)",
        ),
        (
            _doc({"train": {"a.b": 1}}),
            FormatError,
            "config.train.a.b: table key 'a.b' is not a field name; keys are dataclass field names: non-empty, no '.'",
        ),
    ],
)
def test_read_refuses_malformed_snapshots_with_a_format_error(tmp_path, data, error, message):
    path = tmp_path / "a.config.json"
    path.write_bytes(data)
    with pytest.raises(error) as e:
        read_snapshot(path)
    assert type(e.value) is error
    assert str(e.value) == f"{path}: {message}"


def test_read_refuses_a_file_over_16_mib(tmp_path):
    path = tmp_path / "a.config.json"
    path.write_bytes(b" " * (16 * 1024 * 1024 + 1))
    with pytest.raises(FormatError) as e:
        read_snapshot(path)
    assert str(e.value) == (
        f"{path}: file too large for a config snapshot (expected <= 16777216 bytes, got > 16777216); "
        "is this a checkpoint? its snapshot is <ckpt>.config.json"
    )


def test_read_accepts_a_file_of_exactly_16_mib(tmp_path):
    path = tmp_path / "a.config.json"
    body = _doc({"lr": 0.1})
    path.write_bytes(body + b" " * (16 * 1024 * 1024 - len(body)))
    assert read_snapshot(path).config == {"lr": 0.1}


# --------------------------------------------------------------------------- diff_keys


def test_diff_keys_accepts_flat_nested_snapshot_and_dataclass_alike():
    new = Cfg(train=TrainCfg(lr=2e-3))
    nested = snapshot_config(Cfg())
    flat = {
        "model.d": 4,
        "model.act": Act.GELU,
        "model.dropout": None,
        "seed": 1,
        "train.lr": 1e-3,
        "train.steps": 10,
        "train.betas": (0.9, 0.95),
        "train.rand_depth": False,
    }
    expected = [KeyDiff("train.lr", 1e-3, 2e-3, "changed", exempt=False)]
    for old in (Cfg(), nested, flat, Snapshot(nested, "x.Cfg")):
        assert diff_keys(old, new) == expected


def test_diff_keys_exempts_default_names_at_any_nesting_depth():
    old = {"steps": 1, "train": {"steps": 1, "log_every": 1}, "a": {"b": {"eval_every": 1, "eval": 1}}, "ckpt_every": 1}
    new = {"steps": 2, "train": {"steps": 2, "log_every": 2}, "a": {"b": {"eval_every": 2, "eval": 2}}, "ckpt_every": 2}
    diffs = diff_keys(old, new)
    assert [d.key for d in diffs] == [
        "a.b.eval",
        "a.b.eval_every",
        "ckpt_every",
        "steps",
        "train.log_every",
        "train.steps",
    ]
    assert all(d.exempt and not d.strict for d in diffs)
    assert {"steps", "log_every", "ckpt_every", "eval", "eval_every"} == DEFAULT_EXEMPT


def test_diff_keys_custom_exempt_set_replaces_the_default():
    old, new = {"train": {"steps": 1, "lr": 0.1}}, {"train": {"steps": 2, "lr": 0.2}}
    assert [(d.key, d.exempt) for d in diff_keys(old, new, exempt={"lr"})] == [
        ("train.lr", True),
        ("train.steps", False),
    ]
    # A dotted name matches that exact path only.
    assert [(d.key, d.exempt) for d in diff_keys(old, new, exempt={"train.lr"})] == [
        ("train.lr", True),
        ("train.steps", False),
    ]
    assert [d.exempt for d in diff_keys({"a": {"lr": 1}}, {"a": {"lr": 2}}, exempt={"train.lr"})] == [False]


def test_diff_keys_reports_dead_and_new_keys_sorted():
    diffs = diff_keys({"z": 1, "a": {"dead": 3}, "m": 1}, {"z": 1, "a": {"live": 4}, "m": 2})
    assert diffs == [
        KeyDiff("a.dead", 3, None, "only_old", exempt=False),
        KeyDiff("a.live", None, 4, "only_new", exempt=False),
        KeyDiff("m", 1, 2, "changed", exempt=False),
    ]


def test_diff_keys_compares_numbers_exactly_by_value_and_never_bool_as_int():
    assert diff_keys({"a": 1, "b": 0.0, "c": [1, 2]}, {"a": 1.0, "b": -0.0, "c": (1.0, 2)}) == []
    assert diff_keys({"x": 1}, {"x": True}) == [KeyDiff("x", 1, True, "changed", exempt=False)]
    assert diff_keys({"x": 0.1}, {"x": math.nextafter(0.1, 1)})[0].kind == "changed"
    assert diff_keys({"x": None}, {"x": 0})[0].kind == "changed"
    assert diff_keys({"x": "1"}, {"x": 1})[0].kind == "changed"


def test_diff_keys_refuses_a_string_as_the_exempt_set():
    with pytest.raises(TypeError) as e:
        diff_keys({}, {}, exempt="steps")
    assert str(e.value) == "exempt must be a set of key names, not the string 'steps'"


def test_key_diff_describes_itself_in_one_human_line():
    assert (
        KeyDiff("train.steps", 1000, 2000, "changed", True).describe() == "train.steps 1000 -> 2000: extending the run"
    )
    assert KeyDiff("steps", 2000, 1000, "changed", True).describe() == "steps 2000 -> 1000: shortening the run"
    assert KeyDiff("log_every", 10, 20, "changed", True).describe() == (
        "log_every 10 -> 20: exempt (decides when we look, not what the model computes)"
    )
    assert KeyDiff("model.act", "gelu", "relu", "changed", False).describe() == 'model.act "gelu" -> "relu"'
    assert (
        KeyDiff("old", 3, None, "only_old", False).describe()
        == "old 3 -> (absent): dead key, the config no longer has it"
    )
    assert (
        KeyDiff("new", None, [1], "only_new", False).describe()
        == "new (absent) -> [1]: the snapshot never carried this key"
    )
    assert (
        str(KeyDiff("eval", 1, None, "only_old", True))
        == "eval 1 -> (absent): dead key, the config no longer has it; exempt"
    )


def test_key_diff_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match=r"^kind must be one of changed, only_old, only_new \(got 'gone'\)$"):
        KeyDiff("a", 1, 2, "gone", False)


# --------------------------------------------------------------------------- check_resume


def test_check_resume_lists_every_strict_difference_at_once(tmp_path):
    path = tmp_path / "step-00000010.ckpt.config.json"
    write_snapshot(path, Cfg())
    new = Cfg(model=ModelCfg(act=Act.RELU), train=TrainCfg(lr=2e-3, steps=20, rand_depth=True), seed=2)
    with pytest.raises(ConfigDrift) as e:
        check_resume(path, new)
    assert str(e.value) == (
        f"config drift: 4 strict differences from the run's snapshot ({path}):\n"
        '  model.act "gelu" -> "relu"\n'
        "  seed 1 -> 2\n"
        "  train.lr 0.001 -> 0.002\n"
        "  train.rand_depth false -> true\n"
        "resuming would continue a different run; restore these values, or start a new run in a new directory"
    )
    assert e.value.differences == [
        KeyDiff("model.act", "gelu", "relu", "changed", False),
        KeyDiff("seed", 1, 2, "changed", False),
        KeyDiff("train.lr", 1e-3, 2e-3, "changed", False),
        KeyDiff("train.rand_depth", False, True, "changed", False),
    ]


def test_check_resume_passes_exempt_changes_and_reports_them():
    diffs = check_resume(snapshot_config(Cfg()), Cfg(train=TrainCfg(steps=2000)))
    assert diffs == [KeyDiff("train.steps", 10, 2000, "changed", True)]
    assert [d.describe() for d in diffs] == ["train.steps 10 -> 2000: extending the run"]


def test_check_resume_with_a_custom_exempt_set():
    with pytest.raises(ConfigDrift) as e:
        check_resume(snapshot_config(Cfg()), Cfg(train=TrainCfg(steps=2000, lr=0.5)), exempt={"lr"})
    assert [(d.key, d.exempt) for d in e.value.differences] == [("train.steps", False)]


def test_check_resume_compares_a_field_missing_from_an_old_snapshot_at_its_default():
    old = snapshot_config(Cfg())
    del old["train"]["rand_depth"]
    assert check_resume(old, Cfg()) == []
    with pytest.raises(ConfigDrift) as e:
        check_resume(old, Cfg(train=TrainCfg(rand_depth=True)))
    assert e.value.differences == [KeyDiff("train.rand_depth", False, True, "changed", False)]
    assert str(e.value).splitlines()[1] == "  train.rand_depth false -> true"


def test_check_resume_fills_a_whole_table_missing_from_an_old_snapshot_with_its_defaults():
    old = snapshot_config(Cfg())
    del old["model"]
    assert check_resume(old, Cfg()) == []
    with pytest.raises(ConfigDrift) as e:
        check_resume(old, Cfg(model=ModelCfg(d=8)))
    assert e.value.differences == [KeyDiff("model.d", 4, 8, "changed", False)]


def test_check_resume_refuses_a_field_without_default_missing_from_the_snapshot():
    Req = dataclasses.make_dataclass("Req", [("depth", int), ("lr", float, 0.1)])
    with pytest.raises(ConfigDrift) as e:
        check_resume({"lr": 0.1}, Req(depth=3))
    assert e.value.differences == [KeyDiff("depth", None, 3, "only_new", False)]
    assert str(e.value) == (
        "config drift: 1 strict difference from the run's snapshot:\n"
        "  depth (absent) -> 3: the snapshot never carried this key\n"
        "resuming would continue a different run; restore these values, or start a new run in a new directory"
    )


def test_check_resume_assumes_no_default_the_snapshot_could_not_carry():
    Clip = dataclasses.make_dataclass("Clip", [("clip", float, math.inf)])
    with pytest.raises(ConfigDrift) as e:
        check_resume({}, Clip(clip=1.0))
    assert e.value.differences == [KeyDiff("clip", None, 1.0, "only_new", False)]


def test_check_resume_refuses_a_dead_key_instead_of_dropping_it():
    old = snapshot_config(Cfg())
    old["train"]["warmup"] = 100
    with pytest.raises(ConfigDrift) as e:
        check_resume(old, Cfg())
    assert e.value.differences == [KeyDiff("train.warmup", 100, None, "only_old", False)]


def test_check_resume_never_fills_a_default_under_a_key_the_snapshot_has():
    # The snapshot says model was None; the config now has a table there.
    old = snapshot_config(Cfg())
    old["model"] = None
    with pytest.raises(ConfigDrift) as e:
        check_resume(old, Cfg())
    assert [(d.key, d.kind) for d in e.value.differences] == [
        ("model", "only_old"),
        ("model.act", "only_new"),
        ("model.d", "only_new"),
        ("model.dropout", "only_new"),
    ]


def test_check_resume_names_an_unreadable_snapshot(tmp_path):
    with pytest.raises(CheckpointNotFound):
        check_resume(tmp_path / "missing.config.json", Cfg())


# --------------------------------------------------------------------------- coverage


def test_coverage_passes_on_a_good_nested_config():
    report = assert_field_coverage(Cfg, exempt_fields={"train.log_dir": "where logs go; never read by a step"})
    assert report.ok
    assert report.fields == (
        "model.act",
        "model.d",
        "model.dropout",
        "seed",
        "train.betas",
        "train.log_dir",
        "train.lr",
        "train.rand_depth",
        "train.steps",
    )
    assert len(report.written) == 8
    assert str(report) == "field coverage ok: the snapshot carries 8 of 9 fields"


def _problems(cfg, **kwargs) -> tuple[str, ...]:
    """The problems the failing check lists, one a line."""
    with pytest.raises(AssertionError) as e:
        assert_field_coverage(cfg, **kwargs)
    return tuple(str(e.value).split("\n  ")[1:])


def test_coverage_fails_on_a_field_opted_out_without_a_reason():
    problems = (
        "count: the snapshot carries 8 keys, the config has 9 fields (0 exempt and absent)",
        (
            'train.log_dir: excluded from the snapshot (metadata={"snapshot": False}) without a reason; '
            'declare it in exempt_fields={"train.log_dir": "why it cannot change a step"}'
        ),
    )
    with pytest.raises(AssertionError) as e:
        assert_field_coverage(Cfg)
    assert str(e.value) == "field coverage: 2 problems:\n  " + "\n  ".join(problems)


def test_coverage_fails_on_an_exemption_without_a_reason_or_field():
    assert _problems(Cfg, exempt_fields={"train.log_dir": "  ", "train.gone": "old"}) == (
        "train.gone: declared in exempt_fields but the config has no such field",
        "train.log_dir: declared in exempt_fields without a reason; write why it cannot change a step",
    )


def test_coverage_fails_on_a_snapshot_function_that_drops_a_field():
    def dropping(cfg):
        table = snapshot_config(cfg)
        del table["train"]["rand_depth"]  # the ADR-0021 item 5 bug
        return table

    assert _problems(Cfg(), exempt_fields={"train.log_dir": "output path"}, snapshot=dropping) == (
        "count: the snapshot carries 7 keys, the config has 9 fields (1 exempt and absent)",
        "train.rand_depth: a field of the config the snapshot does not carry",
    )


def test_coverage_fails_on_a_key_the_snapshot_carries_but_never_changes():
    def decorating(cfg):
        table = snapshot_config(cfg)
        table["seed"] = 1  # written, but not from the config: decoration
        return table

    assert _problems(Cfg(), exempt_fields={"train.log_dir": "output path"}, snapshot=decorating) == (
        "seed: flipping 1 -> 2 does not reach diff_keys (the snapshot carries it but does not change: decoration)",
    )


def test_coverage_fails_on_a_key_the_snapshot_carries_that_is_no_field():
    def extra(cfg):
        return {**snapshot_config(cfg), "note": "x"}

    assert _problems(Flat, snapshot=extra) == (
        "count: the snapshot carries 4 keys, the config has 3 fields (0 exempt and absent)",
        "note: in the snapshot but not a field of the config",
    )


def test_coverage_classes_exempt_fields_by_the_exempt_set():
    assert assert_field_coverage(Flat, exempt={"lr"}).ok  # lr flips as exempt, steps as strict: each as the set says


@dataclass
class NeedsFlip:
    opaque: object = None  # no annotation to build another value from
    mode: str = "a"

    def __post_init__(self) -> None:
        if self.mode not in ("a", "b"):
            raise ValueError(f"mode must be 'a' or 'b' (got {self.mode!r})")


def test_coverage_asks_for_flips_where_no_automatic_flip_exists_and_uses_them():
    assert _problems(NeedsFlip) == (
        (
            "mode: flipping 'a' -> 'ax' fails (ValueError: mode must be 'a' or 'b' (got 'ax')); "
            'pass flips={"mode": <another valid value>}'
        ),
        'opaque: no automatic flip for None; pass flips={"opaque": <another valid value>}',
    )
    assert assert_field_coverage(NeedsFlip, flips={"opaque": 3, "mode": "b"}).ok


def test_coverage_flips_optional_enum_and_tuple_fields_automatically():
    Opt = dataclasses.make_dataclass("Opt", [("x", int | None, None), ("e", Act, Act.RELU), ("t", tuple, (1, "a"))])
    assert assert_field_coverage(Opt).ok


def test_coverage_refuses_a_class_that_needs_arguments():
    Req = dataclasses.make_dataclass("Req", [("depth", int)])
    with pytest.raises(TypeError) as e:
        assert_field_coverage(Req)
    assert str(e.value).startswith("Req cannot be built without arguments (")
    assert assert_field_coverage(Req(depth=2)).ok


# --------------------------------------------------------------------------- properties


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = 3


_NAMES = st.sampled_from([*sorted(DEFAULT_EXEMPT), "lr", "seed", "rand_depth", "act", "betas", "d"]) | st.from_regex(
    r"[a-z][a-z0-9_]{0,6}", fullmatch=True
).filter(lambda n: not keyword.iskeyword(n) and n != "self" and not hasattr(type, n))

_LEAVES = {
    "bool": (bool, st.booleans()),
    "int": (int, st.integers(-(2**70), 2**70)),
    "float": (float, st.floats(allow_nan=False, allow_infinity=False)),
    "str": (str, st.text(max_size=8)),
    "enum": (Color, st.sampled_from(Color)),
    "none": (type(None), st.none()),
    "list": (list[int], st.lists(st.integers(-5, 5), max_size=3)),
    "tuple": (tuple[float, ...], st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=3).map(tuple)),
}


@st.composite
def configs(draw, depth=0):
    names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    specs, values = [], {}
    for name in names:
        kind = draw(st.sampled_from(sorted(_LEAVES) + (["table"] if depth < 2 else [])))
        if kind == "table":
            value = draw(configs(depth + 1))
            specs.append((name, type(value)))
        else:
            typ, strategy = _LEAVES[kind]
            value = draw(strategy)
            specs.append((name, typ))
        values[name] = value
    cls = dataclasses.make_dataclass(f"Random{depth}", specs, frozen=draw(st.booleans()))
    return cls(**values)


def _leaf_paths(cfg, prefix=""):
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += _leaf_paths(value, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _test_flip(value):
    """The test's own flip, independent of the library's."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, Color):
        members = list(Color)
        return members[(members.index(value) + 1) % len(members)]
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        up = math.nextafter(value, math.inf)
        return up if math.isfinite(up) else math.nextafter(value, 0.0)
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 0
    return type(value)([*value, 0])


def _set(cfg, path, value):
    head, _, rest = path.partition(".")
    if rest:
        value = _set(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: value})


def _json_value(value):
    if isinstance(value, Color):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


@settings(max_examples=examples(6))
@given(data=st.data())
def test_a_single_field_flip_is_reported_as_exactly_that_key_with_its_class(data):
    cfg = data.draw(configs())
    path = data.draw(st.sampled_from(_leaf_paths(cfg)))
    old = _json_value(_get(cfg, path))
    new_value = _test_flip(_get(cfg, path))
    flipped = _set(cfg, path, new_value)
    leaf = path.rsplit(".", 1)[-1]
    expected = [KeyDiff(path, old, _json_value(new_value), "changed", leaf in DEFAULT_EXEMPT)]
    assert diff_keys(cfg, flipped) == expected
    assert diff_keys(snapshot_config(cfg), snapshot_config(flipped)) == expected
    if leaf in DEFAULT_EXEMPT:
        assert check_resume(snapshot_config(cfg), flipped) == expected
    else:
        with pytest.raises(ConfigDrift) as e:
            check_resume(snapshot_config(cfg), flipped)
        assert e.value.differences == expected


def _get(cfg, path):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


@settings(max_examples=examples(3))
@given(cfg=configs())
def test_random_configs_round_trip_through_the_file_and_pass_their_own_resume(cfg):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step-00000001.ckpt.config.json")
        write_snapshot(path, cfg)
        snap = read_snapshot(path)
        with open(path, "rb") as f:
            assert f.read() == encode_snapshot(cfg)
    assert snap.config == snapshot_config(cfg)
    assert diff_keys(snap, cfg) == []
    assert check_resume(snap, cfg) == []
    # A None annotated NoneType has no other value to flip to: the test supplies one.
    flips = {p: 0 for p in _leaf_paths(cfg) if _get(cfg, p) is None}
    assert assert_field_coverage(cfg, flips=flips).ok


@settings(max_examples=examples(8))
@given(data=st.data())
def test_damaged_snapshot_bytes_raise_only_format_errors(data):
    good = encode_snapshot(Cfg())
    damaged = data.draw(
        st.one_of(
            st.binary(max_size=64),
            st.integers(0, len(good)).map(lambda n: good[:n]),
            st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
                lambda p: good[: p[0]] + bytes([good[p[0]] ^ p[1]]) + good[p[0] + 1 :]
            ),
        )
    )
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.config.json")
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            snap = read_snapshot(path)
        except FormatError:
            return
    # What still parses is a valid snapshot: the resume check runs to a verdict.
    with contextlib.suppress(ConfigDrift):
        check_resume(snap, Cfg())


# --------------------------------------------------------------------------- a config given as a table


def test_a_table_config_is_written_canonically_with_its_config_type():
    table = {"args": {"lr": 0.01, "betas": (0.9, 0.95), "kwargs": {"warmup": 3}}, "model": {"id2label": {"0": "A"}}}
    data = encode_snapshot(table, "my.Trainer")
    doc = json.loads(data)
    assert doc == {
        "config": {
            "args": {"betas": [0.9, 0.95], "kwargs": {"warmup": 3}, "lr": 0.01},
            "model": {"id2label": {"0": "A"}},
        },
        "config_type": "my.Trainer",
        "schema_version": 1,
    }
    assert data == encode_snapshot(dict(reversed(list(table.items()))), "my.Trainer")  # same config, same bytes


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"args": {"a.b": 1}},
            "config field args.'a.b': cannot snapshot the key; table keys are non-empty strings without '.'",
        ),
        (
            {"args": {0: 1}},
            "config field args.0: cannot snapshot the key; table keys are non-empty strings without '.'",
        ),
        ({"args": {"x": object}}, "config field args.x: cannot snapshot a type"),
    ],
)
def test_a_table_config_refuses_what_a_snapshot_cannot_carry_naming_the_key(table, message):
    with pytest.raises(UnsupportedValue) as e:
        encode_snapshot(table)
    assert str(e.value).startswith(message)


def test_check_resume_of_a_table_compares_missing_keys_at_the_defaults_given():
    old = {"args": {"lr": 0.01}}  # written before args.seed existed
    assert check_resume(old, {"args": {"lr": 0.01, "seed": 42}}, defaults={"args.seed": 42}) == []
    with pytest.raises(ConfigDrift) as e:
        check_resume(old, {"args": {"lr": 0.02, "seed": 7}}, defaults={"args.seed": 42})
    assert str(e.value).splitlines() == [
        "config drift: 2 strict differences from the run's snapshot:",
        "  args.lr 0.01 -> 0.02",
        "  args.seed 42 -> 7",
        "resuming would continue a different run; restore these values, or start a new run in a new directory",
    ]
    with pytest.raises(ConfigDrift, match=r"args.seed \(absent\) -> 42: the snapshot never carried this key"):
        check_resume(old, {"args": {"lr": 0.01, "seed": 42}})  # no defaults: a new key is strict


def test_check_resume_refuses_a_config_that_is_neither_a_dataclass_nor_a_table():
    with pytest.raises(
        UnsupportedValue, match=r"^check_resume needs the config as a dataclass instance or a table \(got list\)$"
    ):
        check_resume({"a": 1}, [1])


def test_an_empty_table_is_not_filled_with_the_default_of_its_key():
    # TrainingArguments(lr_scheduler_kwargs={}): the field's default is None, the run's value an empty table.
    snapshot = {"args": {"kwargs": {}, "lr": 0.1}}
    assert check_resume(snapshot, {"args": {"kwargs": {}, "lr": 0.1}}, defaults={"args.kwargs": None}) == []
