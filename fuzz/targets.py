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
import resource
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import xxhash

__all__ = ["READERS_CONTAINER", "READERS_SIDECAR", "cap_memory", "exercise", "finding", "reseal"]

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
