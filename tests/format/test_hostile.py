"""Hostile files: every reader raises a typed ckptkit error, in bounded memory and time.

The corpus is ``fixtures/hostile/`` (built by ``fixtures/hostile/generate.py``,
expected errors in its ``MANIFEST.json``); ``fuzz/run_corpus.py`` runs it through
``ckptkit.load``, ``ckptkit.verify``, the sidecar readers and ``ckptkit verify`` /
``ckptkit inspect [--json]`` in a subprocess whose address space is capped at its
post-import size + 512 MiB. Around it: every truncation and bit flip of small
valid files, u64 lies at every offset, and hypothesis properties over arbitrary
bytes and structure-aware index mutations (spec/guarantees.md, "Hostile files").
"""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import msgpack
import pytest
import torch
from helpers import examples, hostile_generator, linear_run, load_script
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.errors import BadMagic, CheckpointError, FormatError
from ckptkit.format._checkpoint import Checkpoint, load, save
from ckptkit.format._sidecar import read_sidecar, verify_sidecar, write_sidecar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTILE = os.path.join(ROOT, "fixtures", "hostile")
FUZZ = os.path.join(ROOT, "fuzz")
FUZZ_SECONDS = examples(0.08)  # the harness's budget follows the profile too: 2 s under ci, 80 s under thorough


gen = hostile_generator()
sys.path.insert(0, FUZZ)
targets = load_script("targets", Path(FUZZ) / "targets.py")

with open(os.path.join(HOSTILE, "MANIFEST.json"), encoding="utf-8") as _f:
    MANIFEST = json.load(_f)
CASES = {c["file"]: c for c in MANIFEST["cases"]}


def _bytes(name: str) -> bytes:
    with open(os.path.join(HOSTILE, name), "rb") as f:
        return f.read()


# ------------------------------------------------------------------ the corpus itself


def test_the_hostile_corpus_regenerates_byte_for_byte(tmp_path):
    assert gen.check(HOSTILE) == [], "run: python fixtures/hostile/generate.py"
    gen.write(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([*CASES, "MANIFEST.json"])


def test_the_independent_writer_agrees_with_ckptkit_byte_for_byte(tmp_path):
    """generate.py restates the format with struct+msgpack; its valid bases must be
    exactly what ckptkit writes, or its lies would be lies about another format."""
    f32 = lambda t: torch.frombuffer(bytearray(t.raw), dtype=torch.float32).reshape(t.shape)  # noqa: E731
    state = Checkpoint(
        step=7,
        model={"w": f32(gen.W), "b": f32(gen.B)},
        optim={"lr": 0.5, "t": torch.tensor([5, -1], dtype=torch.int64), "betas": (0.9, 0.999)},
        monitor={"data": {"train": 128}, "values": {"note": "x"}},
    )
    save(tmp_path / "a.ckpt", state)
    assert (tmp_path / "a.ckpt").read_bytes() == _bytes("ok-base.ckpt")
    write_sidecar(
        tmp_path / "a.ngram", train_step=7, table_step=3, tree={"counts": torch.tensor([5, -1], dtype=torch.int64)}
    )
    assert (tmp_path / "a.ngram").read_bytes() == _bytes("ok-sidecar.ngram")
    ck = load(os.path.join(HOSTILE, "ok-v1.ckpt"))
    assert ck.legacy and ck.step == 42 and ck.optim == {"lr": 0.5}
    assert torch.equal(ck.model["w"], f32(gen.W))


# ------------------------------------------------------------------ every case, every reader, capped


@pytest.fixture(scope="module")
def corpus_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "results.json"
    marker = tmp_path_factory.mktemp("marker") / "pwned"
    env = {**os.environ, MANIFEST["marker_env"]: str(marker), "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(FUZZ, "run_corpus.py"), "--json", str(out), "--mem-mib", "512"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stderr[-3000:]
    with open(out, encoding="utf-8") as f:
        results = json.load(f)
    results["by_file"] = {c["file"]: c for c in results["cases"]}
    results["marker_path"] = str(marker)
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hostile_file_gets_its_typed_error_from_every_reader(corpus_results, name):
    got = corpus_results["by_file"][name]
    assert got["findings"] == [], json.dumps(got["outcomes"], indent=1)
    assert got["wrong"] == {}, json.dumps(got["wrong"], indent=1)
    assert got["seconds"] < 10.0, f"a reader took {got['seconds']} s"


def test_mutated_commit_records_and_leases_raise_only_ckptkit_errors(corpus_results):
    """fuzz/run_corpus.py's seeded mutations of the golden commit records and of leases (spec/objectstore.md
    R-O12/R-O13/R-O46..R-O48, spec/lease.md R-LS15), under the same memory cap as the corpus."""
    records = corpus_results["records"]
    assert records["inputs"] > 400 and records["findings"] == [], json.dumps(records["findings"][:5], indent=1)
    assert records["seconds"] < 10.0


def test_no_pickle_payload_ever_runs(corpus_results):
    assert corpus_results["marker"] == corpus_results["marker_path"]
    assert not corpus_results["marker_exists"] and not os.path.exists(corpus_results["marker_path"])


def test_the_pickle_payloads_would_run_a_command_if_unpickled(tmp_path):
    """Proof that the corpus pickles are live, so the test above means something."""
    marker = tmp_path / "pwned"
    env = {**os.environ, MANIFEST["marker_env"]: str(marker)}
    with zipfile.ZipFile(io.BytesIO(_bytes("pickle-os-system-zip.pt"))) as z:
        zipped = z.read("archive/data.pkl")
    for payload in (_bytes("pickle-os-system.pt"), zipped, _bytes("pickle-disguised-as-v1.ckpt")):
        assert not marker.exists()
        subprocess.run(
            [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
            input=payload,
            env=env,
            check=True,
            timeout=60,
        )
        assert marker.exists()
        marker.unlink()


def test_readers_never_reach_for_pickle(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a reader tried to unpickle")

    for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    for name in ("pickle-os-system.pt", "pickle-os-system-zip.pt"):
        with pytest.raises(BadMagic, match="never unpickles"):
            load(os.path.join(HOSTILE, name))
        assert not ckptkit.verify(os.path.join(HOSTILE, name)).ok
        with pytest.raises(BadMagic):
            read_sidecar(os.path.join(HOSTILE, name))
    ck = load(os.path.join(HOSTILE, "pickle-inside-tree.ckpt"))
    assert ck.monitor == {"payload": gen.pwn_pickle()}  # bytes stay bytes


# ------------------------------------------------------------------ resume falls back past a hostile file


@pytest.fixture(scope="module")
def valid_run(tmp_path_factory):
    """A run directory with valid checkpoints at steps 1 and 2 (model + ngram sidecar)."""
    make = linear_run
    d = tmp_path_factory.mktemp("run") / "run"
    rs, net = make(d)
    rs.start()
    for s in (1, 2):
        with torch.no_grad():
            net.weight.add_(1.0)
        rs.save(s)
    return d, make


RESUME_CASES = sorted(n for n, c in CASES.items() if c["error"] != "ok")


@pytest.mark.parametrize("name", RESUME_CASES)
def test_resume_skips_a_hostile_newest_file_and_falls_back(tmp_path, valid_run, name):
    """G-13: whatever the newest checkpoint (or its sidecar) holds, resume says why it
    skipped it and restores the previous one -- it never crashes on it."""
    import shutil

    src, make = valid_run
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    victim = run_dir / ("step-00000002.ckpt.ngram" if CASES[name]["kind"] == "sidecar" else "step-00000002.ckpt")
    victim.write_bytes(_bytes(name))
    rs, net = make(run_dir)
    info = rs.resume()
    assert info.step == 1 and [p for p, _ in info.skipped] == [str(run_dir / "step-00000002.ckpt")], info
    assert torch.equal(net.weight, make(tmp_path / "fresh")[1].weight + 1.0)


# ------------------------------------------------------------------ every truncation / flip / u64 lie


def _zstd_base(tmp_path) -> bytes:
    save(
        tmp_path / "z.ckpt",
        Checkpoint(
            step=3, model={"w": torch.arange(40, dtype=torch.float32)}, optim={"m": torch.ones(9, dtype=torch.bfloat16)}
        ),
        compression="zstd",
    )
    return (tmp_path / "z.ckpt").read_bytes()


def _readers(path: str, kind: str) -> list:
    if kind == "sidecar":
        return [lambda: read_sidecar(path, expect_step=7), lambda: verify_sidecar(path, expect_step=7)]

    def v():
        r = ckptkit.verify(path)
        if not r.ok:
            raise r.error

    return [lambda: load(path), v]


def _only_typed(path, kind: str, must_fail: bool) -> None:
    """Every reader of ``kind`` either succeeds or raises a FormatError naming ``path``."""
    for read in _readers(str(path), kind):
        try:
            read()
        except FormatError as e:
            assert e.path == str(path), e  # noqa: PT017 - a reader may also succeed: no pytest.raises
            continue
        except CheckpointError as e:
            pytest.fail(f"{type(e).__name__} is not a FormatError: {e}")
        assert not must_fail, "a damaged file was accepted"


@pytest.mark.parametrize("base", ["ok-base.ckpt", "zstd", "ok-sidecar.ngram", "ok-v1.ckpt"])
def test_every_truncation_raises_a_typed_error_naming_the_file(tmp_path, base):
    data = _zstd_base(tmp_path) if base == "zstd" else _bytes(base)
    kind = "sidecar" if base.endswith(".ngram") else "container"
    cut = tmp_path / "cut"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        _only_typed(cut, kind, must_fail=True)


@pytest.mark.parametrize("base", ["ok-base.ckpt", "zstd", "ok-sidecar.ngram"])
def test_every_single_bit_flip_is_caught(tmp_path, base):
    data = _zstd_base(tmp_path) if base == "zstd" else _bytes(base)
    kind = "sidecar" if base.endswith(".ngram") else "container"
    p = tmp_path / "flip"
    for i in range(len(data)):
        for bit in (0, 7):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            p.write_bytes(bad)
            _only_typed(p, kind, must_fail=True)


_U64_LIES = (0, 1, 7, 63, 64, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 64, 2**64 - 1)


@pytest.mark.parametrize("base", ["ok-base.ckpt", "zstd", "ok-sidecar.ngram", "ok-v1.ckpt"])
def test_a_u64_lie_at_any_offset_resealed_or_not_raises_only_typed_errors(tmp_path, base):
    data = _zstd_base(tmp_path) if base == "zstd" else _bytes(base)
    kind = "sidecar" if base.endswith(".ngram") else "container"
    p = tmp_path / "lie"
    extra = (len(data), len(data) - 8)
    for i in range(len(data) - 7):
        # every offset gets one of the lies, in rotation: each value lands in every field over the sweep
        lies = (*_U64_LIES, *extra, len(data) - i)
        for v in (lies[i % len(lies)],):
            bad = data[:i] + struct.pack("<Q", v % 2**64) + data[i + 8 :]
            for variant in (bad, targets.reseal(bad)):
                p.write_bytes(variant)
                _only_typed(p, kind, must_fail=False)


# ------------------------------------------------------------------ properties


@settings(max_examples=examples(12), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=512), prefix=st.sampled_from([b"", b"DMCK\x00\x02\x00\x00", b"DMSC\x00\x01\x00\x00"]))
def test_arbitrary_bytes_raise_only_ckptkit_errors(tmp_path, data, prefix):
    p = tmp_path / "any"
    raw = prefix + data
    p.write_bytes(raw)
    _only_typed(p, "container", must_fail=False)
    _only_typed(p, "sidecar", must_fail=False)
    # a v1 header that adds up, so the legacy path parses its sections
    v1 = struct.pack("<QQQ", 1, len(raw), 0) + raw
    p.write_bytes(v1)
    _only_typed(p, "container", must_fail=False)


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=10),
    st.sampled_from(["raw", "zstd", "float32", "uint8", "int64", "bool", "tensors"]),
    st.sampled_from([0, 64, 2**63, 2**64 - 1]),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=5)),
    st.builds(msgpack.ExtType, st.just(1), st.binary(min_size=4, max_size=4)),
    st.just(msgpack.Timestamp(1, 0)),
)
_values = st.recursive(
    _leaves,
    lambda c: (
        st.lists(c, max_size=4) | st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 9)), c, max_size=4)
    ),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value):
    if not path:
        return value
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return obj


@pytest.fixture(scope="module")
def mutation_bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    return {
        "ok-base.ckpt": _bytes("ok-base.ckpt"),
        "zstd": _zstd_base(d),
        "ok-sidecar.ngram": _bytes("ok-sidecar.ngram"),
    }


@settings(max_examples=examples(16), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_lie_inside_an_index_raises_only_ckptkit_errors(tmp_path, mutation_bases, data):
    """Structure-aware: decode one section index, replace any node of it with any
    msgpack value, re-pack, fix every length and reseal every digest, so the lie
    reaches the check behind the integrity checks."""
    name = data.draw(st.sampled_from(sorted(mutation_bases)))
    raw = mutation_bases[name]
    sites = targets.index_sites(raw)
    start, n = data.draw(st.sampled_from(sites))
    index = msgpack.unpackb(raw[start + 8 : start + 8 + n], raw=False, strict_map_key=False)
    path = data.draw(st.sampled_from(list(_paths(index))))
    op = data.draw(st.sampled_from(["set", "drop"]))
    if op == "drop" and path:
        parent = index
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
    else:
        index = _set(index, path, data.draw(_values))
    bad = targets.reseal(targets.replace_index(raw, start, n, msgpack.packb(index, use_bin_type=True)))
    p = tmp_path / "mut"
    p.write_bytes(bad)
    _only_typed(p, "sidecar" if name.endswith(".ngram") else "container", must_fail=False)


# ------------------------------------------------------------------ the fuzz harness, briefly


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hypothesis", "atheris"])
def test_the_fuzz_harness_runs_clean_for_a_bounded_time(tmp_path, engine):
    """The harness works and finds nothing in a short budget (long campaigns: ``fuzz/fuzz_load.py --seconds N``)."""
    if engine == "atheris":
        pytest.importorskip("atheris")
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        os.path.join(FUZZ, "fuzz_load.py"),
        "--seconds",
        str(FUZZ_SECONDS),
        "--engine",
        engine,
        "--seed",
        "0",
        "--corpus",
        str(tmp_path / "corpus"),
        "--artifacts",
        str(tmp_path / "artifacts"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    findings = [line for line in (proc.stdout + proc.stderr).splitlines() if "FINDING" in line]
    assert proc.returncode == 0 and not findings, "\n".join(findings[:5]) or proc.stderr[-3000:]


def test_the_typed_value_fuzz_target_runs_clean_for_a_bounded_time(tmp_path, capsys):
    """Typed-value payloads behind resealed digests: every reader typed, load and verify agreeing
    (``fuzz/fuzz_typed_values.py --seconds N`` for long campaigns)."""
    typed = load_script("fuzz_typed_values", Path(FUZZ) / "fuzz_typed_values.py")
    status = typed.run(FUZZ_SECONDS, 0, str(tmp_path / "artifacts"))
    assert status == 0, capsys.readouterr().err[-3000:]


# ------------------------------------------------------------------ not a regular file


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_like_a_checkpoint_is_refused_not_waited_on(tmp_path):
    """A reader must never block on a path that is not a regular file (a FIFO
    blocks in open() until a writer appears: ``ckptkit verify run/`` would hang)."""
    fifo = tmp_path / "step-00000001.ckpt"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    code = (
        "import sys, ckptkit\n"
        "from ckptkit.cli import main\n"
        "try:\n    ckptkit.load(sys.argv[1])\n"
        "except ckptkit.CheckpointError as e:\n    print('typed', type(e).__name__)\n"
        "sys.exit(main(['verify', sys.argv[1]]) + 10)\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("ckptkit blocked opening a FIFO (open it O_NONBLOCK and refuse non-regular files)")
    assert proc.stdout.startswith("typed ") and proc.returncode in (11, 12), proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 1
