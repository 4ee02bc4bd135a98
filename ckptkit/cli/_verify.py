"""``ckptkit verify PATH...``: check every byte of checkpoint files and their companions (torch-free).

ckptkit verify run/step-00000100.ckpt
ckptkit verify run/ --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound, UnreadableFile
from ..format._place import place_for
from ..format._verify import Report, verify
from ..run._resume_check import verdict_line
from ._paths import expand_checkpoints
from ._progress import Progress

__all__ = ["URL_ARGS", "add_parser", "run"]

#: Arguments that may be ``s3://`` URLs (a checkpoint object or a run prefix, spec/objectstore.md).
URL_ARGS = ("paths",)

_EPILOG = """\
example:
  $ ckptkit verify run/
  OK    run/step-00000100.ckpt  v2 step 100  1.2 MiB  flags: -
  FAIL  run/step-00000200.ckpt: offset 1156 (0x484): monitor_len: ... runs past the end of the file

  OK    run/step-00000100.ckpt.config.json  snapshot, bound to step-00000100.ckpt
  FAIL  run/step-00000200.ckpt.config.json: damaged: its xxh3-64 does not match the digest ...

A checkpoint's companions (its config snapshot, its sidecars, the run's environment.json)
are checked against the digests it records (spec/companions.md); in a run directory a
missing one fails too. A checkpoint that records none (written before companion binding)
gets a WARN line: its companions are not protected.

What an interrupted save or deletion left in a run directory (a step-N.dcp/ without
metadata.ckdcp, a companion without its checkpoint) is no checkpoint: it gets a WARN line,
is not checked, and the next start or resume removes it.

exit codes: 0 every file valid, 1 any file invalid, 2 usage error or unreadable path
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check every byte of checkpoint files",
        description="Check every byte of one or more checkpoints (files, or run directories), the "
        "companions each records (snapshot, sidecars, environment.json), and a run's history.jsonl.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint file or run directory (or s3://bucket/prefix)")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema_version 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr (shown on a terminal for 2+ files)")


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
            {
                "name": s.name,
                "offset": s.offset,
                "length": s.length,
                "codec": s.codec,
                "tensors": s.tensors,
                "raw_len": s.raw_len,
            }
            for s in r.sections
        ],
    }


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # gone already: the loop reports it
        return 0


def _verify_any(path: str) -> Report:
    """A container or a sidecar, told apart by the magic."""
    from ..format._container import Source

    try:
        with Source(path) as src:  # refuses FIFOs and devices instead of blocking on them
            magic = src.pread(0, min(4, src.size), "magic")
    except UnreadableFile:  # a directory, FIFO, device, symlink loop: verify reports it as FAIL
        return verify(path)
    if magic == b"DMSC":
        from ..format._sidecar import sidecar_report

        return sidecar_report(path)
    return verify(path)


def run(args: argparse.Namespace) -> int:
    from . import _distributed, _trainer

    # A Hugging Face Trainer output directory or checkpoint-N/ folder (spec/transformers.md).
    fetched = {p for p in args.paths if place_for(p).fetches}  # s3://: checked against commit records (_remote)
    urls = [p for p in args.paths if p in fetched]
    trainer_folders, paths = _trainer.split([p for p in args.paths if p not in fetched])
    trainer_checks = _trainer.check_all(trainer_folders)
    dirs = [p for p in paths if _distributed.is_distributed_dir(p)]
    # A distributed run directory: its step-N.dcp/ directories, and its sidecars as files.
    runs = {p: _distributed.run_contents(p) for p in paths if os.path.isdir(p) and p not in dirs}
    # What interrupted saves left in a run directory is no checkpoint: a WARN line each, not checked.
    debris = _debris(list(runs))
    runs = {p: (_kept(steps, debris), _kept(rest, debris)) for p, (steps, rest) in runs.items()}
    only_dcp = {p for p, (steps, _) in runs.items() if steps and not expand_checkpoints_or_none(p)}
    only_debris = {p for p, (steps, _) in runs.items() if not steps and _only_debris(p, debris)}
    dir_reports = _distributed.verify_all(dirs + [d for steps, _ in runs.values() for d in steps])
    try:
        files = expand_checkpoints([p for p in paths if p not in dirs and p not in only_dcp | only_debris])
        files = [f for f in files if f not in debris] + [s for p in only_dcp for s in runs[p][1]]
    except CheckpointNotFound as e:
        print(f"ckptkit verify: {e}", file=sys.stderr)
        return 2
    reports = _verify_files(files, quiet=args.quiet)
    if reports is None:
        return 2
    companions = _companion_checks(reports, paths, dir_reports)
    if urls:
        from ._remote import verify_urls

        reports += verify_urls(urls)
    histories = _history_checks(paths)
    ok = all(r.ok for r in reports + dir_reports) and all(c["ok"] for c in companions) and all(h.ok for h in histories)
    ok = ok and all(c.ok for c in trainer_checks)
    if args.json:
        files_json = [report_json(r) for r in reports] + [_distributed.report_json(r) for r in dir_reports]
        history_json = [_history_json(h) for h in histories]
        doc = {"schema_version": 1, "ok": ok, "files": files_json, "companions": companions, "history": history_json}
        if trainer_checks:  # present only then, so the other outputs keep their shape
            doc["trainer_checkpoints"] = [_trainer.folder_json(c) for c in trainer_checks]
        if debris:  # likewise
            doc["incomplete"] = [{"path": p, "why": why} for p, why in sorted(debris.items())]
        print(json.dumps(doc, sort_keys=True))
    else:
        for path, why in sorted(debris.items()):
            print(f"WARN  {path}: incomplete, not a checkpoint: {why}; the next start or resume removes it")
        _trainer.print_checks(trainer_checks, _size)
        _distributed.print_reports(dir_reports, _size)
        for r in reports:
            _print_report(r)
        for c in companions:
            _print_companion(c)
        for h in histories:
            _print_history(h)
    return 0 if ok else 1


def _debris(run_dirs: list[str]) -> dict[str, str]:
    """Path -> why, for what interrupted saves and deletions left in each run directory."""
    from ..run._files import CKPT_SUFFIX, DCP_SUFFIX, debris

    found = {}
    for d in run_dirs:
        for suffix in (CKPT_SUFFIX, DCP_SUFFIX):
            found.update({os.path.join(d, name): why for name, why in debris(d, suffix)})
    return found


def _kept(paths: list[str], debris: dict[str, str]) -> list[str]:
    return [p for p in paths if p not in debris]


def _only_debris(run_dir: str, debris: dict[str, str]) -> bool:
    """A run directory holding debris and no checkpoint (a run killed in its first save)."""
    mine = [p for p in debris if p.startswith(os.path.join(run_dir, ""))]
    return bool(mine) and all(f in debris for f in expand_checkpoints_or_none(run_dir))


def _verify_files(files: list[str], *, quiet: bool) -> list[Report] | None:
    """Verify each file, with a progress bar over their bytes; None when a path is not a regular file
    (said on stderr: exit 2). A file deleted since it was listed is skipped, said on stderr."""
    reports = []
    # The bar counts bytes, so its rate and ETA hold for a few large files as for many small ones.
    sizes = [_file_size(p) for p in files]
    done, total = 0, sum(sizes)
    with Progress("verify", quiet=quiet or len(files) < 2, unit="B") as progress:
        progress.at(0, total)
        for path, size in zip(files, sizes, strict=True):
            try:
                reports.append(_verify_any(path))
            except CheckpointNotFound as e:
                if os.path.lexists(path):  # there, but not a regular file
                    progress.log(str(e), always=True)
                    return None
                # Deleted between listing and reading (retention in a live run): not a failure.
                progress.log(f"{path}: deleted while verifying (retention?); skipped", always=True)
            done += size
            progress.at(done, total)
    return reports


def _print_report(r: Report) -> None:
    if r.ok and r.kind == "object":
        print(f"OK    {r.path}  object, {_size(r.size)}, size and xxh3-64 match its commit record")
    elif r.ok:
        legacy = f"  legacy: lacks {', '.join(r.missing)}" if r.legacy else ""
        flags = ", ".join(r.flags) or "-"
        kind = f"sidecar v{r.version}" if r.kind == "sidecar" else f"v{r.version}"
        print(f"OK    {r.path}  {kind} step {r.step}  {_size(r.size)}  flags: {flags}{legacy}")
    else:
        print(f"FAIL  {r.error}" if str(r.error).startswith(r.path) else f"FAIL  {r.path}: {r.error}")


def _history_json(h: Any) -> dict[str, Any]:
    return {
        "path": h.path,
        "ok": h.ok,
        "rows": h.rows,
        "torn": h.torn,
        "steps": None if h.steps is None else list(h.steps),
        "problems": list(h.problems),
        "resumes": [{k: v for k, v in r.items() if k not in ("kind", "step")} for r in h.resumes],
    }


def _history_checks(paths: list[str]) -> list[Any]:
    """``history.jsonl`` of each run directory given: no checksum, so what can be
    checked is (spec/trainer.md R-T13)."""
    from ..run._history import HISTORY_FILE, HistoryCheck, check_history

    found = sorted({os.path.join(p, HISTORY_FILE) for p in paths if os.path.isdir(p)})
    out = []
    for h in (h for h in found if os.path.lexists(h)):
        try:
            out.append(check_history(h))
        except UnreadableFile as e:  # a FIFO, a directory, /dev/zero: FAIL, never waited on or read
            out.append(HistoryCheck(h, 0, None, False, (str(e).removeprefix(f"{h}: "),)))
        except CheckpointNotFound:  # a dangling symlink: a history that is gone
            out.append(HistoryCheck(h, 0, None, False, ("a symlink to nothing",)))
    return out


def _print_history(h: Any) -> None:
    for problem in h.problems[:10]:
        print(f"FAIL  {h.path}: {problem}")
    if len(h.problems) > 10:
        print(f"FAIL  {h.path}: and {len(h.problems) - 10} more problem(s)")
    if h.torn:
        print(f"WARN  {h.path}: torn last line (a crash mid-append); the next resume drops it")
    if h.ok:
        steps = "no step rows" if h.steps is None else f"steps {h.steps[0]}..{h.steps[1]}"
        print(f"OK    {h.path}  history, {h.rows} rows, {steps} (no checksum: rows, order and _bits checked)")
    for r in h.resumes:  # each resume's proof (spec/determinism.md R-D23)
        if r["verdict"] is None:
            print(f"      resume at step {r['resumed_at']}: no verdict recorded (the resume check was not run)")
        else:
            print(f"{'WARN' if r['verdict'] == 'differed' else '':<6}{verdict_line(r)}")


def expand_checkpoints_or_none(run_dir: str) -> list[str]:
    """The one-process checkpoints and sidecars of ``run_dir``; empty when it holds none."""
    try:
        return expand_checkpoints([run_dir])
    except CheckpointNotFound:
        return []


def _companion_checks(reports: list[Report], paths: list[str], dir_reports: list[Any]) -> list[dict[str, Any]]:
    """The companions of every checkpoint that verified (a container, or a distributed
    RunState directory), one entry per file (spec/companions.md).

    In a run directory a recorded companion that is missing fails (the checkpoint
    cannot be resumed); beside a checkpoint named on its own, only those present
    are checked, and its sidecars are verified byte for byte too.
    """
    from ..format._companions import companion_checks, read_record
    from . import _distributed

    run_dirs = {os.path.normpath(p) for p in paths if os.path.isdir(p)}
    merged: dict[str, dict[str, Any]] = {}
    targets: list[tuple[str, Callable[[str], dict[str, Any] | None]]]
    targets = [(r.path, read_record) for r in reports if r.ok and r.kind == "container"]
    targets += [(d.path, _distributed.read_run_record) for d in dir_reports if d.ok]
    records: dict[str, Any] = {}
    for path, read in targets:
        try:
            records[path] = read(path)
        except CheckpointNotFound:  # deleted since it verified (retention in a live run)
            continue
        except CheckpointError as e:  # a record this reader cannot trust checks nothing (R-C01)
            merged[path] = {
                "path": path,
                "kind": "record",
                "checkpoints": [path],
                "ok": False,
                "protected": True,
                "error": {"type": type(e).__name__, "message": str(e)},
            }
    kinds = _run_sidecar_kinds(records, run_dirs)
    for path, record in records.items():
        run_dir = os.path.normpath(os.path.dirname(path) or ".")
        in_run = run_dir in run_dirs
        wanted = kinds.get(run_dir, set()) | _sidecars_beside(path) if in_run else set()
        checks = companion_checks(path, record, missing_ok=not in_run, sidecars=sorted(wanted))
        if any(isinstance(c.error, CheckpointNotFound) for c in checks) and not os.path.exists(path):
            continue  # retention deleted the checkpoint, then its companions, while we read (G-31)
        _merge(merged, path, checks, in_run)
    # A sidecar of a run directory has its own line already; its binding is news only when it fails.
    return [
        e
        for _, e in sorted(merged.items())
        if not (e["kind"] == "sidecar" and e["ok"] and os.path.normpath(os.path.dirname(e["path"])) in run_dirs)
    ]


def _run_sidecar_kinds(records: dict[str, Any], run_dirs: set[str]) -> dict[str, set[str]]:
    """Per run directory, the sidecar kinds its checkpoints record: what its resume reads (R-C04)."""
    kinds: dict[str, set[str]] = {}
    for path, record in records.items():
        run_dir = os.path.normpath(os.path.dirname(path) or ".")
        if run_dir in run_dirs and record is not None:
            kinds.setdefault(run_dir, set()).update(record["sidecars"])
    return kinds


def _sidecars_beside(path: str) -> set[str]:
    """The kinds of the sidecar files ``<checkpoint>.<kind>`` beside a checkpoint of a run directory."""
    from ..format._place import list_run_dir
    from ..format._snapshot import SNAPSHOT_SUFFIX

    head = os.path.basename(path) + "."
    names = list_run_dir(os.path.dirname(path) or ".")
    return {n[len(head) :] for n in names if n.startswith(head) and n != os.path.basename(path) + SNAPSHOT_SUFFIX}


def _merge(merged: dict[str, dict[str, Any]], ckpt_path: str, checks: list[Any], in_run: bool) -> None:
    """Fold one checkpoint's companion verdicts into ``merged`` (a file shared by several
    checkpoints, like environment.json, is one entry naming them all)."""
    from ..format._sidecar import sidecar_report

    for c in checks:
        error = c.error
        if error is None and c.kind == "sidecar" and not in_run:
            error = sidecar_report(c.path).error
        entry = merged.setdefault(
            c.path,
            {"path": c.path, "kind": c.kind, "checkpoints": [], "ok": True, "protected": c.protected, "error": None},
        )
        entry["checkpoints"].append(ckpt_path)
        if error is not None and entry["ok"]:
            entry.update(ok=False, error={"type": type(error).__name__, "message": str(error)})


def _print_companion(c: dict[str, Any]) -> None:
    n = len(c["checkpoints"])
    names = os.path.basename(c["checkpoints"][0]) if n == 1 else f"{n} checkpoints"
    if not c["ok"]:
        message = c["error"]["message"]
        print(f"FAIL  {message}" if message.startswith(c["path"]) else f"FAIL  {c['path']}: {message}")
    elif not c["protected"]:
        print(
            f"WARN  {c['path']}: not protected: {names} records no companion digests "
            "(written before companion binding); it parses, nothing more is checked"
        )
    else:
        print(f"OK    {c['path']}  {c['kind']}, bound to {names}")
