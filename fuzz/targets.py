"""Run every ckptkit reader on one file and classify what happened.

Shared by the fuzz harness (``fuzz/fuzz_load.py``), the corpus runner
(``fuzz/run_corpus.py``) and ``tests/format/test_hostile.py``. A reader may succeed or
raise a :class:`ckptkit.errors.CheckpointError`; anything else -- ``struct.error``,
``IndexError``, ``KeyError``, ``UnicodeDecodeError``, ``MemoryError``,
``OverflowError``, ``RecursionError``, a torch ``RuntimeError``, a CLI
"internal error", a traceback, a multi-line diagnostic -- is a *finding*.

    from targets import exercise
    outcomes = exercise("/tmp/x.ckpt")          # {"load": "ok", "verify": "TruncatedFile", ...}
    findings = [o for o in outcomes.values() if o.startswith("!")]
"""

from __future__ import annotations

import contextlib
import io
import re
import resource
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import xxhash

__all__ = [
    "HOSTILE_JSON",
    "READERS_CONTAINER",
    "READERS_LEASE",
    "READERS_RECORD",
    "READERS_SIDECAR",
    "cap_memory",
    "exercise",
    "exercise_lease",
    "exercise_record",
    "finding",
    "mutate_json",
    "reseal",
]

READERS_CONTAINER = ("load", "verify", "cli-verify", "cli-inspect", "cli-inspect-json")
READERS_SIDECAR = ("read_sidecar", "verify_sidecar")


def finding(outcome: str) -> bool:
    """An outcome that breaks the rule "malformed input raises only ckptkit errors"."""
    return outcome.startswith("!")


def _call(fn: Callable[[], Any], path: str | None = None) -> str:
    from ckptkit.errors import CheckpointError, FormatError

    try:
        got = fn()
    except CheckpointError as e:
        if path is not None and isinstance(e, FormatError) and e.path != path:
            return f"!{type(e).__name__} does not name the file (path={e.path!r}): {e}"
        if "\n" in str(e):
            return f"!{type(e).__name__} message is not one line: {str(e)[:200]!r}"
        return type(e).__name__
    except BaseException as e:  # classifying is the point
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"!{type(e).__name__}: {str(e)[:200]}"
    return "ok" if got is None else str(got)


def _cli(argv: list[str]) -> str:
    """``ckptkit ARGV`` in process: ``rc<N>`` if it behaved, ``!...`` if not."""
    from ckptkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    lines = err.getvalue().splitlines()
    if rc not in (0, 1, 2):
        return f"!rc {rc}: {err.getvalue()[:200]}"
    if "internal error" in err.getvalue() or "Traceback" in err.getvalue() + out.getvalue():
        return f"!rc {rc} internal error: {err.getvalue().strip()[:200]}"
    if rc != 0 and len(lines) != 1 and argv[0] == "inspect":
        return f"!rc {rc} with {len(lines)} stderr lines: {err.getvalue()[:200]}"
    if (
        rc != 0
        and argv[0] == "verify"
        and not (rc == 1 and out.getvalue().startswith("FAIL") and len(out.getvalue().splitlines()) == 1 and not lines)
    ):
        return f"!rc {rc}: stdout {out.getvalue()[:100]!r} stderr {err.getvalue()[:100]!r}"
    if rc == 0 and err.getvalue():
        return f"!rc 0 but stderr: {err.getvalue()[:200]}"
    return f"rc{rc}"


def declared_tensor_bytes(path: str, kind: str) -> int:
    """Bytes of tensor memory the file asks a loader to allocate (0 if it does not parse)."""
    from ckptkit.format import _container as container
    from ckptkit.format import _sidecar as sidecar

    try:
        with container.Source(path) as src:
            layout = sidecar._layout(src)[0] if kind == "sidecar" else container.read_layout(src)
    except Exception:  # noqa: BLE001 - a pre-check: the readers themselves report what is wrong
        return 0
    return sum(t.nbytes for s in layout.sections.values() if s is not None for t in s.tensors)


def exercise(
    path: str,
    *,
    kind: str = "container",
    expect_step: int | None = None,
    skip: tuple[str, ...] = (),
    max_load_bytes: int = 256 << 20,
) -> dict[str, str]:
    """Run every reader of ``kind`` on ``path``.

    A file that *declares* more than ``max_load_bytes`` of tensors (legitimately
    possible: a zstd section may expand 32768-fold) is not loaded -- a loader
    must allocate what the file holds -- but still verified, which must not.

    Returns:
        reader name -> ``"ok"``, the ckptkit error class name, ``"rc0"``/``"rc1"``
        for the CLI, or ``"!..."`` for a finding. Each outcome also gets a
        ``"<reader>:seconds"`` entry.
    """
    if declared_tensor_bytes(path, kind) > max_load_bytes:
        skip = (*skip, "load", "read_sidecar")
    import ckptkit
    from ckptkit.format import _sidecar as sidecar

    def verify_report() -> str | None:
        r = ckptkit.verify(path)
        if r.ok != (r.error is None):
            raise AssertionError("report.ok disagrees with report.error")
        return None if r.ok else type(r.error).__name__

    readers: dict[str, Callable[[], str]] = {}
    if kind == "container":
        readers = {
            "load": lambda: _call(lambda: (ckptkit.load(path), None)[1], path),
            "verify": lambda: _call(verify_report),
            "cli-verify": lambda: _cli(["verify", path]),
            "cli-inspect": lambda: _cli(["inspect", path]),
            "cli-inspect-json": lambda: _cli(["inspect", "--json", path]),
        }
    else:
        readers = {
            "read_sidecar": lambda: _call(lambda: (sidecar.read_sidecar(path, expect_step=expect_step), None)[1], path),
            "verify_sidecar": lambda: _call(
                lambda: (sidecar.verify_sidecar(path, expect_step=expect_step), None)[1], path
            ),
        }
    out: dict[str, str] = {}
    for name, fn in readers.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        out[name] = fn()
        out[f"{name}:seconds"] = f"{time.perf_counter() - t0:.3f}"
    return out


def cap_memory(extra: int) -> int:
    """Limit this process's address space to its current size + ``extra`` bytes.

    Call it after the imports (torch maps several hundred MiB). Returns the cap.
    A hostile file that makes a reader allocate past it raises MemoryError (or a
    torch allocation error) -- which :func:`exercise` reports as a finding.
    """
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + extra
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return cap


def quiet_threads() -> None:
    """One intra-op thread: fewer surprise mappings under an address-space cap."""
    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(1)


# ------------------------------------------------------------------ resealing digests

_U64 = struct.Struct("<Q")


def reseal(data: bytes) -> bytes:
    """Recompute the digests of a (mutated) v2 container or sidecar so its lies
    reach the checks behind them: every raw tensor digest that sits in its index
    as ``bin8``, and the skeleton digest. Returns ``data`` unchanged when the
    structure does not parse (then the structural check is what gets tested)."""
    from ckptkit.errors import CheckpointError
    from ckptkit.format import _container as container

    if data[:4] == b"DMSC":
        try:
            from ckptkit.format import _sidecar as sidecar

            with container.Source(data=data) as src:
                layout, _ = sidecar._layout(src)
        except CheckpointError:
            return data
    elif data[:4] == b"DMCK":
        try:
            with container.Source(data=data) as src:
                layout = container.read_layout(src)
        except CheckpointError:
            return data
    else:
        return data
    out = bytearray(data)
    for sec in layout.sections.values():
        if sec is None or sec.codec != "raw":
            continue
        for rec in sec.tensors:
            a = sec.data_start + rec.offset
            new = _U64.pack(xxhash.xxh3_64_intdigest(bytes(out[a : a + rec.nbytes])))
            old = b"\xc4\x08" + _U64.pack(rec.digest or 0)
            at = bytes(out[sec.start : sec.data_start]).find(old)
            if at >= 0:
                out[sec.start + at + 2 : sec.start + at + 10] = new
    h = xxhash.xxh3_64()
    for a, b in container.skeleton_extents(layout):
        h.update(bytes(out[a:b]))
    assert layout.trailer_offset is not None
    out[layout.trailer_offset : layout.trailer_offset + 8] = _U64.pack(h.intdigest())
    return bytes(out)


def index_sites(data: bytes) -> list[tuple[int, int]]:
    """``(start, index_len)`` of each section index in a v2 container or sidecar
    (for structure-aware mutation); empty when the structure does not parse."""
    from ckptkit.errors import CheckpointError
    from ckptkit.format import _container as container
    from ckptkit.format import _sidecar as sidecar

    try:
        with container.Source(data=data) as src:
            layout = sidecar._layout(src)[0] if data[:4] == b"DMSC" else container.read_layout(src)
    except CheckpointError:
        return []
    return [(s.start, s.index_len) for s in layout.sections.values() if s is not None]


def replace_index(data: bytes, start: int, index_len: int, new_index: bytes) -> bytes:
    """Swap one section's index for ``new_index`` and fix every length that moves:
    the section's ``index_len``, the padding to the 64-byte boundary, and the
    section length in the container header (v2 only). Digests are not touched
    (see :func:`reseal`)."""
    from ckptkit.format._section import align_up

    old_data_start = align_up(start + 8 + index_len)
    new_data_start = align_up(start + 8 + len(new_index))
    head = _U64.pack(len(new_index)) + new_index + bytes(new_data_start - start - 8 - len(new_index))
    out = bytearray(data[:start]) + head + data[old_data_start:]
    delta = new_data_start - old_data_start
    # the header field holding this section's length: container (model, optim,
    # teacher, monitor) or sidecar (table); sections follow the header back to back
    fields, pos = ((16, 24, 32, 48), 56) if data[:4] == b"DMCK" else ((24,), 32)
    for at in fields:
        n = _U64.unpack_from(data, at)[0]
        if pos == start and n:
            out[at : at + 8] = _U64.pack(n + delta)
            break
        pos += n
    return bytes(out)


def decode_raw_index(data: bytes, start: int, index_len: int) -> Any:
    return msgpack.unpackb(data[start + 8 : start + 8 + index_len], raw=False, strict_map_key=False)


if __name__ == "__main__":  # pragma: no cover - a quick manual probe
    for p in sys.argv[1:]:
        print(p, exercise(p))


# ------------------------------------------------------------------ commit records and leases
# (spec/objectstore.md R-O12/R-O13/R-O46..R-O48, spec/lease.md R-LS15): small JSON records
# whose decoders must refuse any mutation with a ckptkit error.

READERS_RECORD = ("decode_record",)
READERS_LEASE = ("lease-holder", "lease-acquire")

#: Values a mutation writes in place of a JSON scalar: the bounds' edges and beyond.
HOSTILE_JSON = (
    "18446744073709551615",
    "18446744073709551616",
    "1" + "0" * 30,
    "9" * 4300,
    "-1",
    "-0",
    "1.0",
    "1e999",
    "NaN",
    "-Infinity",
    "true",
    "null",
    '""',
    '"\\u0000"',
    '"a/b"',
    '"\\ud800"',
    "[" * 3000 + "]" * 3000,
    "{}",
    '{"a":[[[1]]]}',
    '"' + "x" * 300 + '"',
    str(2**31),
    str(2**70),
)
_SCALAR = re.compile(rb'-?\d[\d.eE+-]*|"(?:[^"\\]|\\.)*"|true|false|null')  # a JSON scalar, roughly


def mutate_json(data: bytes, rng: Any, pool: list[bytes]) -> bytes:
    """``data`` with 1..3 mutations drawn from ``rng`` (a ``random.Random``): a scalar value or
    key replaced by one of :data:`HOSTILE_JSON`, a byte set, bytes inserted, deleted or cut, a
    splice from another seed of ``pool``, or deep brackets wrapped around a value."""
    out = bytes(data)
    for _ in range(rng.randint(1, 3)):
        spots = [m.span() for m in _SCALAR.finditer(out)]
        op = rng.choice(("value", "value", "value", "byte", "insert", "delete", "cut", "splice", "nest"))
        at = rng.randrange(len(out) + 1)
        if op in ("value", "nest") and spots:
            a, b = rng.choice(spots)
            new = rng.choice(HOSTILE_JSON).encode() if op == "value" else b"[" * 50 + out[a:b] + b"]" * 50
            out = out[:a] + new + out[b:]
        elif op == "byte" and out:
            at = min(at, len(out) - 1)
            out = out[:at] + bytes([rng.randrange(256)]) + out[at + 1 :]
        elif op == "insert":
            out = out[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + out[at:]
        elif op == "delete":
            out = out[:at] + out[at + rng.randint(1, 16) :]
        elif op == "cut":
            out = out[:at]
        elif op == "splice":
            other = rng.choice(pool)
            out = out[:at] + other[rng.randrange(len(other) + 1) :]
    return out


def exercise_record(data: bytes) -> dict[str, str]:
    """A commit record's decoder (every reader of an ``s3://`` checkpoint goes through it) on
    ``data``, as the record of ``model.ckpt`` at ``URL``."""
    from ckptkit.format._commit import decode_record

    start = time.perf_counter()
    got = _call(lambda: decode_record(data, "URL", "model.ckpt") and None, "URL")
    return {"decode_record": got, "decode_record:seconds": f"{time.perf_counter() - start:.4f}"}


def exercise_lease(data: bytes, run_dir: str) -> dict[str, str]:
    """A run directory's lease readers on ``data`` as its ``lease.json``: who holds it, and an
    acquire, which judges the holder (its pid on this host, its heartbeat) and may take it over."""
    import os

    from ckptkit.run._lease import LEASE_FILE, lease_for, this_job

    out: dict[str, str] = {}
    for reader in READERS_LEASE:
        with open(os.path.join(run_dir, LEASE_FILE), "wb") as f:
            f.write(data)
        lease = lease_for(run_dir)
        read = lease.holder if reader == "lease-holder" else lambda lease=lease: lease.acquire(this_job(1))
        start = time.perf_counter()
        out[reader] = _call(lambda read=read: read() and None)
        out[f"{reader}:seconds"] = f"{time.perf_counter() - start:.4f}"
        lease.release()
    return out
