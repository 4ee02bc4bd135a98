"""One contract, two places (ckptkit.format._place): every test runs against a local directory and
against an ``s3://`` prefix on the tests' S3 server (tests/conftest.py ``s3``), and must pass
unchanged on both: a record is created once, replaced and removed only on the version read, and
read back with the version its write returned.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointNotFound, CommitConflict, UnsupportedOption
from ckptkit.format._place import LocalPlace, ObjectPlace, Place, local_only, place_and_name, place_for, serves

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets at exit

NAME = "lease.json"


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    """The place under test: a new local run directory, or a new prefix in a new bucket."""
    where = str(tmp_path / "run") if request.param == "local" else f"{request.getfixturevalue('s3')}/run"
    return place_for(where)


def _read(place: Place) -> tuple[bytes, str] | None:
    return place.read(NAME, kind="lease", limit=1 << 16)


def test_a_record_is_created_once_and_read_back_with_the_version_its_write_returned(place: Place) -> None:
    assert _read(place) is None
    version = place.create(NAME, b"first")
    assert _read(place) == (b"first", version)
    with pytest.raises(CommitConflict, match=f"^{place.child(NAME)}: "):
        place.create(NAME, b"second")
    assert _read(place) == (b"first", version)  # the loser wrote nothing


def test_a_record_is_replaced_only_on_the_version_read(place: Place) -> None:
    with pytest.raises(CheckpointNotFound, match=f"^{place.child(NAME)}: "):
        place.replace(NAME, b"x", "no-version")
    first = place.create(NAME, b"first")
    second = place.replace(NAME, b"second", first)
    assert second != first and _read(place) == (b"second", second)
    with pytest.raises(CommitConflict, match=f"^{place.child(NAME)}: "):
        place.replace(NAME, b"third", first)  # a stale version: another writer replaced it since
    assert _read(place) == (b"second", second)


def test_a_record_is_removed_only_on_the_version_read(place: Place) -> None:
    first = place.create(NAME, b"first")
    second = place.replace(NAME, b"second", first)
    with pytest.raises(CommitConflict, match=f"^{place.child(NAME)}: "):
        place.delete_if(NAME, first)
    assert _read(place) == (b"second", second)
    place.delete_if(NAME, second)
    assert _read(place) is None
    with pytest.raises(CheckpointNotFound, match=f"^{place.child(NAME)}: "):
        place.delete_if(NAME, second)
    assert place.create(NAME, b"again")  # gone: the next job creates it


def test_a_read_returns_at_most_its_limit(place: Place) -> None:
    place.create(NAME, b"0123456789")
    found = place.read(NAME, kind="lease", limit=4)
    assert found is not None and found[0] == b"0123"


def test_place_for_is_the_one_url_test(tmp_path: Path, s3: str) -> None:
    assert isinstance(place_for(tmp_path), LocalPlace) and place_for(tmp_path).where == str(tmp_path)
    remote = place_for(f"{s3}/run/")
    assert isinstance(remote, ObjectPlace) and remote.child(NAME) == f"{s3}/run/{NAME}"
    with pytest.raises(UnsupportedOption, match=r"^gs://b/run: the gs:// scheme is not supported; "):
        place_for("gs://b/run")
    assert not (tmp_path / "gs:").exists()


def test_a_path_splits_into_the_place_that_holds_it_and_its_name_there(tmp_path: Path, s3: str) -> None:
    local, name = place_and_name(tmp_path / "run" / "step-3.dcp")
    assert isinstance(local, LocalPlace) and (local.where, name) == (str(tmp_path / "run"), "step-3.dcp")
    remote, name = place_and_name(f"{s3}/run/step-3.dcp/")  # a trailing / is no part of the name
    assert isinstance(remote, ObjectPlace) and remote.child(name) == f"{s3}/run/step-3.dcp"
    assert place_and_name("model.ckpt")[0].where == "."


def test_serves_names_a_local_path_or_a_served_url_and_nothing_else() -> None:
    # DCP asks each storage backend whether it serves a checkpoint_id before it picks one.
    assert serves("run/step-3.dcp") and serves(Path("run")) and serves("s3://bucket/run") and serves("S3://b")
    assert not serves("gs://bucket/run") and not serves("s3://") and not serves(None) and not serves(3)


def test_a_url_is_refused_by_a_local_only_surface_naming_it_and_what_to_do(tmp_path: Path) -> None:
    assert local_only(tmp_path, "ckptkit.run.History") == str(tmp_path)
    with pytest.raises(UnsupportedOption) as info:
        local_only("memory://ckpt", "the manager", option="checkpoint.folder ", why=": it lists local folders")
    assert str(info.value) == (
        "checkpoint.folder memory://ckpt: the manager does not serve memory:// URLs yet (it writes and reads "
        "local files only): it lists local folders"
    )


def test_a_place_says_whether_it_is_read_from_a_fetched_copy_and_makes_what_a_first_file_needs(
    place: Place, tmp_path: Path
) -> None:
    assert place.fetches is isinstance(place, ObjectPlace)  # a local step is read where it is (R-O36)
    place.make()
    place.make()  # made already: nothing to do
    assert (tmp_path / "run").is_dir() is not place.fetches  # a prefix needs no folder, and none is made


def test_a_record_written_in_the_stage_is_at_the_place_once_sent_and_brought_back_whole(place: Place) -> None:
    other = place_for(place.where)  # another job's view of the same place
    assert not other.bring("history.jsonl")  # none yet
    Path(place.stage).mkdir(parents=True, exist_ok=True)
    (Path(place.stage) / "history.jsonl").write_bytes(b'{"kind":"start","step":0}\n')
    place.send("history.jsonl")
    assert other.bring("history.jsonl")
    assert (Path(other.stage) / "history.jsonl").read_bytes() == b'{"kind":"start","step":0}\n'
    with (Path(other.stage) / "history.jsonl").open("ab") as f:
        f.write(b'{"kind":"step","step":0}\n')
    other.send("history.jsonl")
    place.send("history.jsonl")  # unchanged since it was sent: nothing goes over the other's rows
    assert place.bring("history.jsonl")
    assert (Path(place.stage) / "history.jsonl").read_bytes().count(b"\n") == 2
    place.send("missing.json")  # none in the stage: nothing
    assert not other.bring("missing.json")
    stage = place.stage
    other.close()
    place.close()
    assert os.path.isdir(stage) == isinstance(place, LocalPlace)  # a local stage is the run directory itself


def _commit_step(place: Place, name: str, text: bytes | None = None) -> None:
    """A step committed as a store commits it: its companion written in the stage, then the container
    written by the place (``text`` in both, else ``bytes of <file name>``)."""
    Path(place.stage).mkdir(parents=True, exist_ok=True)
    companion = f"{name}.config.json"
    (Path(place.stage) / companion).write_bytes(text or f"bytes of {companion}".encode())
    place.commit(name, [companion], lambda f: f.write(text or f"bytes of {name}".encode()))


def test_a_step_written_in_the_stage_is_committed_named_fetched_and_removed_record_first(place: Place) -> None:
    other = place_for(place.where)  # another job's view: it sees only what the place holds
    name = "step-00000001.ckpt"
    assert other.names(".ckpt") == {}
    _commit_step(place, name)
    assert other.names(".ckpt") == {name: True}
    here = other.fetch(name)
    assert Path(here).read_bytes() == b"bytes of step-00000001.ckpt"
    assert (Path(here).parent / f"{name}.config.json").read_bytes() == b"bytes of step-00000001.ckpt.config.json"
    other.release(name)
    other.remove(name, [os.path.join(other.stage, name), os.path.join(other.stage, f"{name}.config.json")])
    assert place.names(".ckpt") == {}
    assert not os.path.exists(os.path.join(place.stage, name))  # (a local stage is the place)


def test_a_step_saved_again_replaces_the_committed_one(place: Place) -> None:
    name = "step-00000002.ckpt"
    _commit_step(place, name)
    place.make_room(name)
    _commit_step(place, name, b"again")
    other = place_for(place.where)
    assert Path(other.fetch(name)).read_bytes() == b"again"
    assert other.names(".ckpt") == {name: True}


def test_a_listed_fetch_brings_only_the_objects_kept_and_a_local_step_is_read_where_it_is(place: Place) -> None:
    """What a distributed resume reads whole (metadata, companions) comes down; what it reads by
    range (the rank files) stays at the place (spec/objectstore.md R-O36)."""
    name = "step-00000003.ckpt"
    _commit_step(place, name)
    other = place_for(place.where)
    here = Path(other.fetch(name, only=lambda key: key.endswith(".config.json")))
    assert (here.parent / f"{name}.config.json").read_bytes() == b"bytes of step-00000003.ckpt.config.json"
    if isinstance(other, LocalPlace):
        assert here == Path(place.where) / name and here.read_bytes() == b"bytes of step-00000003.ckpt"
    else:
        assert not here.exists()  # the object left out is not fetched
    other.release(name)
    assert place.names(".ckpt") == {name: True}  # a release frees the copy, never the step
