"""``ckptkit verify PATH...``: check every byte of checkpoint files (torch-free).

    ckptkit verify run/step-00000100.ckpt
    ckptkit verify run/ --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..container import Report, verify
from ..errors import CheckpointNotFound
from ._paths import expand_checkpoints

__all__ = ["add_parser", "run"]

_EPILOG = """\
example:
  $ ckptkit verify run/
  OK    run/step-00000100.ckpt  v2 step 100  1.2 MiB  flags: -
  FAIL  run/step-00000200.ckpt: offset 1156 (0x484): monitor_len: ... runs past the end of the file

exit codes: 0 every file valid, 1 any file invalid, 2 usage error or unreadable path
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify", help="check every byte of checkpoint files",
        description="Check every byte of one or more checkpoints (files, or run directories).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint file or run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema_version 1)")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # pragma: no cover


def report_json(r: Report) -> dict[str, Any]:
    """A report as plain JSON values (also used by ``inspect --json``)."""
    return {
        "path": r.path,
        "kind": r.kind,
        "ok": r.ok,
        "error": None if r.error is None else {"type": type(r.error).__name__, "message": str(r.error)},
        "version": r.version,
        "step": r.step,
        "flags": list(r.flags),
        "legacy": r.legacy,
        "missing": list(r.missing),
        "size": r.size,
        "sections": [
            {"name": s.name, "offset": s.offset, "length": s.length, "codec": s.codec, "tensors": s.tensors,
             "raw_len": s.raw_len}
            for s in r.sections
        ],
    }


def _verify_any(path: str) -> Report:
    """A container or a sidecar, told apart by the magic."""
    from ..container import Source

    with Source(path) as src:  # refuses FIFOs and devices instead of blocking on them
        magic = src.pread(0, min(4, src.size), "magic")
    if magic == b"DMSC":
        from ..sidecar import sidecar_report

        return sidecar_report(path)
    return verify(path)


def run(args: argparse.Namespace) -> int:
    from . import _distributed

    dirs = [p for p in args.paths if _distributed.is_distributed_dir(p)]
    dir_reports = _distributed.verify_all(dirs)
    try:
        files = expand_checkpoints([p for p in args.paths if p not in dirs])
    except CheckpointNotFound as e:
        print(f"ckptkit verify: {e}", file=sys.stderr)
        return 2
    reports = []
    for path in files:
        try:
            reports.append(_verify_any(path))
        except CheckpointNotFound as e:
            if os.path.lexists(path):  # there, but not a regular file
                print(f"ckptkit verify: {e}", file=sys.stderr)
                return 2
            # Deleted between listing and reading (retention in a live run): not a failure.
            print(f"ckptkit verify: {path}: deleted while verifying (retention?); skipped", file=sys.stderr)
    if args.json:
        print(json.dumps({"schema_version": 1, "ok": all(r.ok for r in reports + dir_reports),
                          "files": [report_json(r) for r in reports]
                          + [_distributed.report_json(r) for r in dir_reports]}, sort_keys=True))
    else:
        _distributed.print_reports(dir_reports, _size)
        for r in reports:
            if r.ok:
                legacy = f"  legacy: lacks {', '.join(r.missing)}" if r.legacy else ""
                flags = ", ".join(r.flags) or "-"
                kind = f"sidecar v{r.version}" if r.kind == "sidecar" else f"v{r.version}"
                print(f"OK    {r.path}  {kind} step {r.step}  {_size(r.size)}  flags: {flags}{legacy}")
            else:
                print(f"FAIL  {r.error}" if str(r.error).startswith(r.path) else f"FAIL  {r.path}: {r.error}")
    return 0 if all(r.ok for r in reports + dir_reports) else 1
