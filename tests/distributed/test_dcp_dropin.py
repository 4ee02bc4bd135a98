"""ckptkit's Writer/Reader as a drop-in for DCP's FileSystemWriter/FileSystemReader.

The storage behaviours PyTorch's own DCP tests check (``test_file_system_checkpoint*``,
``e2e/test_e2e_save_and_load``, ``test_format_utils``, ``test_save_load_api``,
``test_dtensor_checkpoint``, ``test_dtensor_resharding``), reproduced with the backend
swapped in: the constructors' arguments, save twice into one directory (DCP's default
``overwrite=True``), stream extensions (zstd, chained, a user's own), planner options,
partial loads, loads without a template, async saves, DTensor resharding on real gloo
ranks. The deliberate differences
(``spec/distributed.md`` §9) are tested as refusals with their exact messages.

The crash test SIGKILLs the second of two saves into one directory at every file
operation it makes, from a lab process (``python tests/distributed/test_dcp_dropin.py lab DIR``)
that imports torch once and forks each victim.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import same
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension

import ckptkit
import ckptkit.distributed as ckd
from ckptkit.distributed._format import METADATA_NAME, data_name, read_metadata, verify_directory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "torch.distributed is disabled"


def state(scale: float = 1.0) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale, "b": torch.ones(4) * scale},
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 4)}}, "lr": 0.1 * scale},
        "step": int(scale),
        "names": ["a", "b"],
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
        "optim": {"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.ones(3, 4)}}, "lr": 0.0},
        "step": 0,
        "names": [],
    }


def load(path: str, **kw: Any) -> dict[str, Any]:
    out = blank()
    dcp.load(out, storage_reader=ckd.Reader(path), **kw)
    return out


# ---------------------------------------------------------------------------- the constructors


@pytest.mark.parametrize(("ours", "theirs"), [(ckd.Writer, FileSystemWriter), (ckd.Reader, FileSystemReader)])
def test_the_constructors_take_the_default_classes_arguments_in_their_order(ours, theirs):
    def params(cls: type) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(cls).parameters.values()]

    got, want = params(ours), params(theirs)
    # ckptkit's own, keyword-only after DCP's: the companions an object-storage commit lists (R-O30)
    extra = [p.name for p in inspect.signature(ours).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert extra == (["companions"] if ours is ckd.Writer else [])
    got = [(n, d) for n, d in got if n not in extra]
    assert [n for n, _ in got] == [n for n, _ in want]
    defaults = dict(want)
    defaults.pop("serialization_format", None)  # ours: None, meaning DCP's default (TORCH_SAVE)
    assert {n: d for n, d in got if n in defaults} == defaults


def test_a_writer_built_as_torchtitan_builds_one_saves_and_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    writer = ckd.Writer(
        path, thread_count=2, sync_files=True, overwrite=True, single_file_per_rank=True, per_thread_copy_ahead=0
    )
    dcp.save(state(), storage_writer=writer)
    assert same(load(path), state())
    assert sorted(os.listdir(path)) == [METADATA_NAME, data_name(0)]


def test_sync_files_false_is_accepted_and_every_file_is_still_synced(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = str(tmp_path / "ckpt")
    dcp.save(state(), storage_writer=ckd.Writer(path, sync_files=False))
    names = {os.path.basename(p).split(".tmp.")[0].lstrip(".") for p in synced}
    assert {METADATA_NAME, data_name(0), "ckpt"} <= names


REFUSED = [
    (
        {"single_file_per_rank": False},
        ckptkit.UnsupportedOption,
        (
            "single_file_per_rank=False: ckptkit's format is one data file per rank (spec/distributed.md §1), never "
            "one file per tensor; leave it at True"
        ),
    ),
    (
        {"cache_staged_state_dict": True},
        ckptkit.UnsupportedOption,
        (
            "cache_staged_state_dict=True: ckptkit.distributed.Writer is no stager (dcp.async_save stages for it "
            "with DCP's DefaultStager); for a cached staging copy pass "
            "async_stager=BlockingAsyncStager(cache_staged_state_dict=True) to dcp.async_save"
        ),
    ),
    ({"thread_count": 0}, ValueError, "thread_count must be an int >= 1 (got 0)"),
    ({"per_thread_copy_ahead": -1}, ValueError, "per_thread_copy_ahead must be an int >= 0 (got -1)"),
]


@pytest.mark.parametrize(("kwargs", "cls", "message"), REFUSED)
def test_an_argument_ckptkit_cannot_honour_is_refused_by_name(tmp_path, kwargs, cls, message):
    with pytest.raises(cls) as e:
        ckd.Writer(str(tmp_path / "c"), **kwargs)
    assert str(e.value) == message


def test_a_serialization_format_other_than_dcps_default_is_refused_by_name(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    ckd.Writer(str(tmp_path / "c"), serialization_format=SerializationFormat.TORCH_SAVE)
    with pytest.raises(ckptkit.UnsupportedOption) as e:
        ckd.Writer(str(tmp_path / "c"), serialization_format=SerializationFormat.SAFETENSORS)
    assert str(e.value) == (
        f"serialization_format={SerializationFormat.SAFETENSORS!r}: ckptkit writes its own format (raw chunk "
        "bytes, plain msgpack), neither torch.save nor safetensors files; leave it at the default"
    )


class Rot13(StreamTransformExtension):
    """A stream extension of the user's own: adds 13 to every byte (``shift`` is a faulty writer's)."""

    def __init__(self, drop: int = 0) -> None:
        self.drop = drop

    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    @staticmethod
    def from_descriptor(version: str) -> Rot13:
        return Rot13()

    def get_descriptor(self) -> str:
        return "stream.rot13/1"

    def transform_to(self, output: Any) -> Any:
        ext = self

        class W(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                data = bytes((x + 13) % 256 for x in bytes(b))
                output.write(data[: len(data) - ext.drop])
                return len(memoryview(b))

        return W()

    def transform_from(self, stream: Any) -> Any:
        return io.BytesIO(bytes((x - 13) % 256 for x in stream.read()))


def test_zstd_through_extensions_round_trips_and_stores_less(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    raw, packed = str(tmp_path / "raw"), str(tmp_path / "zstd")
    sd = {**state(), "zeros": torch.zeros(4096)}
    dcp.save(sd, storage_writer=ckd.Writer(raw))
    dcp.save(sd, storage_writer=ckd.Writer(packed, _extensions=[ZStandard()]))
    assert os.path.getsize(os.path.join(packed, data_name(0))) < os.path.getsize(os.path.join(raw, data_name(0))) / 4
    out = {**blank(), "zeros": torch.ones(4096)}
    dcp.load(out, storage_reader=ckd.Reader(packed))
    assert same(out, sd) and verify_directory(packed).ok
    md = read_metadata(packed)
    assert {c.transforms for t in md.tensors.values() for c in t.chunks} == {("stream.zstd/1",)}


def test_two_extensions_chain_as_dcp_chains_them(tmp_path):
    from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard

    path = str(tmp_path / "ckpt")
    dcp.save(state(), storage_writer=ckd.Writer(path, _extensions=[Rot13(), ZStandard()]))
    md = read_metadata(path)
    assert md.tensors["model.w"].chunks[0].transforms == ("stream.rot13/1", "stream.zstd/1")  # reading order
    registry = ExtensionRegistry()
    registry.register(Rot13)
    out = blank()
    dcp.load(out, storage_reader=ckd.Reader(path, _extension_registry=registry))
    assert same(out, state())


def test_a_transform_the_reader_does_not_know_is_refused_by_name(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd_state = {"w": torch.ones(3)}
    dcp.save(ckd_state, storage_writer=ckd.Writer(path, _extensions=[Rot13()]))
    c = read_metadata(path).tensors["w"].chunks[0]
    with pytest.raises(ckptkit.UnsupportedVersion) as e:
        ckd.load({"w": torch.zeros(3)}, path)
    assert str(e.value) == (
        f"{path}/{data_name(0)}: offset {c.offset} (0x{c.offset:x}): tensor 'w': chunk at [0] is stored through "
        "stream.rot13/1, which this reader cannot decode (Unknown extension name='stream.rot13'); pass "
        "Reader(path, _extension_registry=...) with the extension registered (R-DC11)"
    )


def test_the_digest_is_over_the_stored_bytes_checked_before_decoding(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(64)}, storage_writer=ckd.Writer(path, _extensions=[ZStandard()]))
    c = read_metadata(path).tensors["w"].chunks[0]
    f = os.path.join(path, data_name(0))
    with open(f, "r+b") as fh:
        fh.seek(c.offset + c.nbytes - 1)
        last = fh.read(1)[0]
        fh.seek(c.offset + c.nbytes - 1)
        fh.write(bytes([last ^ 0x01]))
    with pytest.raises(ckptkit.ChecksumMismatch, match=r"tensor 'w' chunk at \[0\] of \[64\] \(\d+ bytes\)"):
        ckd.load({"w": torch.zeros(64)}, path)
    assert isinstance(verify_directory(path).error, ckptkit.ChecksumMismatch)


def test_a_transformed_chunk_that_decodes_short_is_refused(tmp_path):
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, storage_writer=ckd.Writer(path, _extensions=[Rot13(drop=1)]))
    c = read_metadata(path).tensors["w"].chunks[0]
    registry = ExtensionRegistry()
    registry.register(Rot13)
    with pytest.raises(dcp.api.CheckpointException):
        dcp.load({"w": torch.zeros(4)}, storage_reader=(reader := ckd.Reader(path, _extension_registry=registry)))
    assert isinstance(reader.failure, ckptkit.MalformedIndex)
    assert str(reader.failure) == (
        f"{path}/{data_name(0)}: offset {c.offset} (0x{c.offset:x}): tensor 'w': chunk at [0] decodes to 15 bytes "
        "(expected 16, got 15); the writer that stored it is faulty (R-DC11)"
    )


def test_an_extension_that_is_no_stream_transform_is_refused_by_name(tmp_path):
    class Foreign:
        def get_descriptor(self) -> str:
            return "layout.sharded/1"

    with pytest.raises(ckptkit.UnsupportedOption) as e:
        ckd.Writer(str(tmp_path / "c"), _extensions=[Foreign(), object()])
    assert str(e.value) == (
        "_extensions: layout.sharded/1, object: not a DCP StreamTransformExtension; ckptkit.distributed applies "
        "stream transforms (such as torch.distributed.checkpoint._extension.ZStandard) to each chunk, nothing else"
    )
    ckd.Writer(str(tmp_path / "c"), _extensions=[])  # DCP: an empty sequence is no extension


URL_MESSAGE = (
    "gs://bucket/ckpt: the gs:// scheme is not supported; ckptkit serves s3:// (S3 and S3-compatible stores, "
    "AWS_ENDPOINT_URL selects one); use s3:// or a local (or mounted) directory"
)


@pytest.mark.parametrize("make", [ckd.Writer, ckd.Reader, lambda p: ckd.Writer("local").reset(p)])
def test_a_url_it_cannot_serve_is_refused_by_name_and_never_becomes_a_local_folder(tmp_path, monkeypatch, make):
    """R-O01, R-O02: s3:// is served (tests/distributed/test_distributed_objectstore.py), any other scheme refused."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptkit.UnsupportedOption) as e:
        make("gs://bucket/ckpt")
    assert str(e.value) == URL_MESSAGE
    with pytest.raises(ckptkit.UnsupportedOption):
        ckd.save({"w": torch.ones(2)}, "gs://bucket/ckpt")
    assert os.listdir(tmp_path) == []


def test_validate_checkpoint_id_takes_local_paths_and_s3_urls():
    for cls in (ckd.Writer, ckd.Reader):
        assert cls.validate_checkpoint_id("ckpt/step-1") and cls.validate_checkpoint_id("/abs/c:d")
        assert cls.validate_checkpoint_id("s3://bucket/ckpt") and cls.validate_checkpoint_id("S3://bucket/ckpt")
        assert not cls.validate_checkpoint_id("file:///tmp/ckpt")


def test_a_checkpoint_id_given_to_dcp_resets_the_storage_classes(tmp_path):
    path = str(tmp_path / "by-id")
    dcp.save(state(), checkpoint_id=path, storage_writer=ckd.Writer(str(tmp_path / "unused")))
    out = blank()
    dcp.load(out, checkpoint_id=path, storage_reader=ckd.Reader(str(tmp_path / "unused")))
    assert same(out, state()) and not os.path.exists(tmp_path / "unused")


# ---------------------------------------------------------------------------- overwrite


def test_saving_twice_into_one_directory_replaces_the_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(state(1.0), storage_writer=ckd.Writer(path))
    dcp.save(state(2.0), storage_writer=ckd.Writer(path))  # DCP's default: overwrite=True
    assert same(load(path), state(2.0))
    assert os.listdir(tmp_path) == ["ckpt"] and verify_directory(path).ok


def test_overwrite_false_refuses_a_committed_checkpoint_with_dcps_words(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd.save(state(1.0), path)
    writer = ckd.Writer(path, overwrite=False)
    with pytest.raises(dcp.api.CheckpointException):
        dcp.save(state(2.0), storage_writer=writer)
    assert isinstance(writer.failure, ckptkit.SaveFailed)
    assert str(writer.failure) == (
        f"{path}: Checkpoint already exists and overwrite=False (R-DC09); save into a new directory, or pass "
        "overwrite=True to replace it atomically"
    )
    assert same(load(path), state(1.0))


def test_the_short_forms_overwrite_only_when_asked(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd.save(state(1.0), path)
    with pytest.raises(ckptkit.SaveFailed, match="Checkpoint already exists and overwrite=False"):
        ckd.save(state(2.0), path)
    ckd.save(state(3.0), path, overwrite=True)
    out = blank()
    ckd.load(out, path)
    assert same(out, state(3.0))


def test_a_stray_replacement_left_by_a_killed_save_is_replaced_by_the_next(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd.save(state(1.0), path)
    stray = tmp_path / ".ckpt.new"
    stray.mkdir()
    (stray / data_name(0)).write_bytes(b"torn")
    ckd.save(state(2.0), path, overwrite=True)
    assert os.listdir(tmp_path) == ["ckpt"] and same(load(path), state(2.0))


def test_a_load_that_races_a_replacement_fails_by_name_never_mixes(tmp_path):
    """A save with overwrite=True lands between the load's metadata read and its chunk reads."""
    path = str(tmp_path / "ckpt")
    ckd.save(state(1.0), path)

    class Racing(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            ckd.save(state(2.0), path, overwrite=True)
            return super().create_local_plan()

    reader = ckd.Reader(path)
    with pytest.raises(dcp.api.CheckpointException):
        dcp.load(blank(), storage_reader=reader, planner=Racing())
    assert isinstance(reader.failure, ckptkit.CheckpointNotFound)
    assert str(reader.failure).startswith(
        f"{path}: the checkpoint was replaced while this load read it (a save with overwrite=True swapped in a new "
        f"one after its metadata was read: {path}/{data_name(0)}: offset "
    )
    assert str(reader.failure).endswith("); do not use state from this failed load, load again")
    assert same(load(path), state(2.0))


def test_an_overwrite_killed_at_every_file_operation_leaves_old_or_new_whole(tmp_path):
    """SIGKILL the second save at each of its file operations (and mid-way through each
    write): the directory always verifies and loads, as the old checkpoint until the swap
    and as the new one from it on; the next save then succeeds and leaves nothing beside."""
    proc = subprocess.run(
        [sys.executable, __file__, "lab", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])},  # ckptkit, helpers
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    ops = [r["op"] for r in runs]
    assert {"create", "write", "fsync", "rename", "dirsync", "unlink", "rmdir"} <= set(ops), ops
    seen = [r["loaded"] for r in runs]
    swap = seen.index("new")
    assert seen[:swap] == ["old"] * swap and seen[swap:] == ["new"] * (len(seen) - swap), runs
    assert runs[swap]["op"] == "dirsync" and runs[swap]["path"] == "."  # the parent's sync right after the swap
    assert all(r["verified"] and r["next_save"] == "new" and r["left"] == ["ckpt"] for r in runs), runs


# ---------------------------------------------------------------------------- planners, partial loads


def test_a_partial_load_leaves_keys_the_checkpoint_lacks(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd.save({"model": {"w": torch.ones(3)}}, path)
    extra = {"model": {"w": torch.zeros(3), "new_head": torch.full((2,), 7.0)}}
    with pytest.raises(ckptkit.StateMismatch, match=r"model\.new_head: missing from the checkpoint"):
        ckd.load(extra, path)
    ckd.load(extra, path, allow_partial=True)
    assert same(extra, {"model": {"w": torch.ones(3), "new_head": torch.full((2,), 7.0)}})
    raw = {"model": {"w": torch.zeros(3), "new_head": torch.zeros(2)}}
    dcp.load(raw, storage_reader=ckd.Reader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert same(raw["model"]["w"], torch.ones(3))


def test_a_partial_load_still_refuses_a_shape_that_differs(tmp_path):
    path = str(tmp_path / "ckpt")
    ckd.save({"w": torch.ones(3)}, path)
    with pytest.raises(ckptkit.StateMismatch) as e:
        ckd.load({"w": torch.zeros(4), "x": torch.zeros(1)}, path, allow_partial=True)
    assert e.value.problems == ("w: the checkpoint's shape is [3], the destination's [4]",)


def test_planner_options_give_what_the_default_backend_gives(tmp_path):
    flat = {"a": torch.ones(2, 2), "b": torch.arange(3), "n": 5}
    outs = []
    for writer, reader in ((ckd.Writer, ckd.Reader), (FileSystemWriter, FileSystemReader)):
        path = str(tmp_path / writer.__name__)
        dcp.save(flat, storage_writer=writer(path), planner=DefaultSavePlanner(flatten_state_dict=False))
        out = {"a": torch.zeros(2, 2), "b": torch.zeros(3, dtype=torch.int64), "n": 0}
        dcp.load(out, storage_reader=reader(path), planner=DefaultLoadPlanner(flatten_state_dict=False))
        outs.append(out)
    # unflattened, DCP loads a top-level non-tensor value into its own copy of the dict: n stays 0 with both
    assert same(outs[0], outs[1]) and same(outs[0], {**flat, "n": 0})
    dedup = str(tmp_path / "dedup")
    dcp.save(state(), storage_writer=ckd.Writer(dedup), planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    assert same(load(dedup), state())


def test_a_load_without_a_template_rebuilds_the_state_dict(tmp_path):
    """What dcp.format_utils.dcp_to_torch_save does: an empty state dict, filled from the metadata."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = str(tmp_path / "ckpt")
    ckd.save(state(), path)
    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=ckd.Reader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert same(out, state())


def test_use_collectives_false_in_a_single_process(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(state(), storage_writer=ckd.Writer(path), no_dist=True, use_collectives=False)
    assert same(load(path), state())


def test_dtypes_shapes_and_views_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    sd = {
        "view": base[:, 1::2],
        "t": base.t(),
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3, dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    }
    ckd.save(sd, path)
    out = {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in sd.items()}
    ckd.load(out, path)
    assert same(out, {k: v.contiguous() for k, v in sd.items()})


def test_async_save_through_the_writer(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.async_save(state(), storage_writer=ckd.Writer(path)).result(timeout=60)
    assert same(load(path), state())


# ---------------------------------------------------------------------------- deliberate differences


def test_a_bytesio_value_is_refused_by_key_never_pickled(tmp_path):
    buf = io.BytesIO(b"train state")
    writer = ckd.Writer(str(tmp_path / "ckpt"))
    with pytest.raises(dcp.api.CheckpointException):
        dcp.save({"w": torch.ones(2), "extra": buf}, storage_writer=writer)
    assert isinstance(writer.failure, ckptkit.UnsupportedValue)
    assert str(writer.failure).startswith("extra: ")
    assert not os.path.exists(tmp_path / "ckpt" / METADATA_NAME)


def test_complex32_is_refused_by_name(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        half = torch.zeros(2, dtype=torch.complex32)
    with pytest.raises(ckptkit.UnsupportedValue, match=r"^c: dtype torch.complex32 is not in the dtype table \("):
        ckd.save({"c": half}, str(tmp_path / "ckpt"))


def test_use_collectives_false_with_several_ranks_is_refused(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    got = pool.run("save_without_collectives", path)
    assert (
        got
        == [
            (
                "UnsupportedOption: use_collectives=False at world size 2: every rank would commit its own "
                "metadata, which breaks the all-ranks-commit rule (R-DC03); ckptkit.distributed.Writer takes "
                "use_collectives=False only in a single process"
            )
        ]
        * 2
    )
    assert not os.path.exists(os.path.join(path, METADATA_NAME))


# ---------------------------------------------------------------------------- DTensor on 2 gloo ranks


@pytest.mark.slow
def test_dtensor_saved_twice_then_resharded_to_columns_and_replicated(pool, tmp_path):
    path = str(tmp_path / "ckpt")
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8) * 2.0
    for got in pool.run("dtensor_overwrite_and_reshard", path):
        assert got["files"] == ["ckpt"]
        for name in ("cols", "replicated"):
            assert torch.equal(got[name][0], full) and got[name][1] == 2, name
    assert verify_directory(path).ok


# ---------------------------------------------------------------------------- the crash lab (child side)


def _lab(work: str) -> None:
    """Save A into ``work/ckpt``; then, for k = 0, 1, ...: fork a victim that saves B over
    it and SIGKILLs itself before its k-th file operation (or half-way through the k-th
    write, for every other write); check what the directory then holds."""
    import builtins
    import shutil
    import signal

    ckpt = os.path.join(work, "ckpt")
    real = {n: getattr(os, n) for n in ("write", "pwrite", "fsync", "replace", "unlink", "rmdir")}
    real_open = builtins.open

    def where(p: str) -> str:
        rel = os.path.relpath(p, work)
        return "." if rel == "." else rel.split(os.sep)[0]

    def victim(kill_at: int, torn: bool) -> None:
        n = [0]

        def event(op: str, path: str, half: Any = None) -> None:
            if n[0] == kill_at:
                print(json.dumps([op, where(path)]), flush=True)
                if torn and half is not None:
                    half()
                os.kill(os.getpid(), signal.SIGKILL)
            n[0] += 1

        def fd_path(fd: int) -> str:
            return os.readlink(f"/proc/self/fd/{fd}")

        def mine(p: str) -> bool:
            return p.startswith(work)

        def write(fd: int, data: Any) -> int:
            p = fd_path(fd)
            if mine(p):
                event("write", p, lambda: real["write"](fd, memoryview(data)[: len(memoryview(data)) // 2]))
            return real["write"](fd, data)

        def pwrite(fd: int, data: Any, off: int) -> int:
            p = fd_path(fd)
            if mine(p):
                mv = memoryview(data)
                event("write", p, lambda: real["pwrite"](fd, mv[: len(mv) // 2], off))
            return real["pwrite"](fd, data, off)

        def fsync(fd: int) -> None:
            p = fd_path(fd)
            if mine(p):
                event("dirsync" if os.path.isdir(p) else "fsync", p)
            real["fsync"](fd)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            if mine(os.path.abspath(os.fspath(dst))):
                event("rename", os.path.abspath(os.fspath(dst)))
            real["replace"](src, dst, **kw)

        def unlink(p: Any, **kw: Any) -> None:
            event("unlink", work if kw.get("dir_fd") is not None else os.path.abspath(os.fspath(p)))
            real["unlink"](p, **kw)

        def rmdir(p: Any, **kw: Any) -> None:
            event("rmdir", work if kw.get("dir_fd") is not None else os.path.abspath(os.fspath(p)))
            real["rmdir"](p, **kw)

        def bopen(file: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
            if isinstance(file, str) and mine(os.path.abspath(file)) and ("x" in mode or "w" in mode):
                event("create", os.path.abspath(file))
            return real_open(file, mode, *a, **kw)

        patched = {"write": write, "pwrite": pwrite, "fsync": fsync, "replace": replace, "unlink": unlink}
        for name, fn in {**patched, "rmdir": rmdir}.items():
            setattr(os, name, fn)
        setattr(builtins, "open", bopen)  # noqa: B010 - the tracer replaces the builtin in this victim only
        dcp.save(state(2.0), storage_writer=ckd.Writer(ckpt))

    def what(path: str) -> str:
        got = load(path)
        return "new" if same(got, state(2.0)) else "old" if same(got, state(1.0)) else "mixed"

    runs, writes = [], 0
    for k in range(10_000):
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(os.path.join(work, ".ckpt.new"), ignore_errors=True)
        ckd.save(state(1.0), ckpt)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.dup2(w, 1)
            code = 1
            try:
                victim(k, torn=writes % 2 == 1)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            said = f.read().strip()
        _, status = os.waitpid(pid, 0)
        if not said:  # the victim ran past its last operation: every kill point is done
            assert os.WEXITSTATUS(status) == 0 and what(ckpt) == "new"
            break
        assert os.WIFSIGNALED(status), status
        op, path = json.loads(said)
        writes += op == "write"
        run = {"op": op, "path": path, "verified": verify_directory(ckpt).ok, "loaded": what(ckpt)}
        ckd.save(state(2.0), ckpt, overwrite=True)
        run.update(next_save=what(ckpt), left=sorted(os.listdir(work)))
        runs.append(run)
    print(json.dumps(runs))


if __name__ == "__main__" and sys.argv[1:2] == ["lab"]:
    _lab(sys.argv[2])
