"""``verify`` and ``inspect`` of a distributed checkpoint directory (spec/distributed.md), torch-free.

A directory is one when it holds ``metadata.ckdcp``, a rank data file, or DCP's
default-backend ``.metadata`` (which is reported for what it is, never unpickled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from ..distributed._format import (
    DCP_DEFAULT_METADATA,
    METADATA_NAME,
    DirMetadata,
    DirReport,
    data_name,
    read_metadata,
    verify_directory,
)
from ..errors import CheckpointError, CheckpointNotFound
from ..format._place import list_run_dir
from ..run._files import DCP_SUFFIX, step_of

__all__ = [
    "diff_directories",
    "directory_tensor_diffs",
    "inspect_directory",
    "is_distributed_dir",
    "print_reports",
    "read_run_record",
    "report_json",
    "run_contents",
]


def is_distributed_dir(path: str) -> bool:
    """True for a directory that is (or was meant to be) a distributed checkpoint."""
    if not os.path.isdir(path):
        return False
    names = list_run_dir(path)
    return (
        METADATA_NAME in names
        or DCP_DEFAULT_METADATA in names
        or any(n.startswith("rank-") and n.endswith(".ckdcp") for n in names)
    )


def run_contents(run_dir: str) -> tuple[list[str], list[str]]:
    """A run directory's distributed checkpoints (``step-N.dcp/``) and their sidecars
    (``step-N.dcp.<kind>``), each sorted; ``([], [])`` for a one-process run."""
    steps, sidecars = [], []
    for name in sorted(list_run_dir(run_dir)):
        path = os.path.join(run_dir, name)
        stem, sep, kind = name.rpartition(DCP_SUFFIX + ".")
        if step_of(name, DCP_SUFFIX) is not None and os.path.isdir(path):
            steps.append(path)
        # step-N.dcp.ngram, not step-N.dcp.config.json
        elif sep and step_of(stem + DCP_SUFFIX, DCP_SUFFIX) is not None and kind.isidentifier():
            sidecars.append(path)
    return steps, sidecars


def read_run_record(path: str) -> dict[str, Any] | None:
    """The companion record a distributed RunState checkpoint carries (its ``run`` value);
    None for a directory ``ckptkit.distributed.save`` wrote without RunState.

    Raises:
        CheckpointError: the metadata cannot be read, or the record is malformed (R-C01).
    """
    from ..format._companions import record_of

    run = read_metadata(path, check_files=False).values.get("run")
    if isinstance(run, tuple) and len(run) == 1:
        return record_of(run[0], path)
    return None


def report_json(r: DirReport) -> dict[str, Any]:
    return {
        "path": r.path,
        "kind": "distributed",
        "ok": r.ok,
        "error": None if r.error is None else {"type": type(r.error).__name__, "message": str(r.error)},
        "world_size": r.world_size,
        "tensors": r.tensors,
        "chunks": r.chunks,
        "values": r.values,
        "size": r.size,
    }


def print_reports(reports: list[DirReport], size: Any) -> None:
    for r in reports:
        if r.ok:
            print(
                f"OK    {r.path}  distributed world size {r.world_size}  {r.tensors} tensors in {r.chunks} chunks, "
                f"{r.values} values  {size(r.size)}"
            )
        else:
            print(f"FAIL  {r.error}" if str(r.error).startswith(r.path) else f"FAIL  {r.path}: {r.error}")


def verify_all(paths: list[str]) -> list[DirReport]:
    return [verify_directory(p) for p in paths]


def inspect_directory(path: str, as_json: bool, size: Any, shown: str | None = None) -> int:
    """Ranks, tensors, chunks and world size at save, once the rank files are this commit's and their
    indexes name the metadata's chunks (R-DC04, R-DC06, as every load checks); chunk digests are not
    checked (verify does). ``shown``: the name to print for ``path`` (an ``s3://`` checkpoint's local
    copy of its metadata, whose rank files are not fetched)."""
    md = read_metadata(path, check_files=shown is None)
    path, local = shown or path, path
    ranks, tensors = _rank_rows(md), _tensor_rows(md)
    if as_json:
        print(
            json.dumps(
                {
                    "schema_version": 1,
                    "path": path,
                    "kind": "distributed",
                    "world_size": md.world_size,
                    "dcp_version": md.dcp_version,
                    "ranks": ranks,
                    "tensors": tensors,
                    "values": sorted(md.values),
                },
                sort_keys=True,
            )
        )
        return 0
    _print_inspection(path, local, md, ranks, tensors, size)
    return 0


def _rank_rows(md: DirMetadata) -> list[dict[str, Any]]:
    """Per rank: its data file, that file's size, and the chunks (and their bytes) it holds."""
    ranks = []
    for rank, f in enumerate(md.files):
        chunks = [(fqn, c) for fqn, t in md.tensors.items() for c in t.chunks if c.rank == rank]
        ranks.append(
            {
                "rank": rank,
                "file": data_name(rank),
                "size": f.size,
                "chunks": len(chunks),
                "bytes": sum(c.nbytes for _, c in chunks),
            }
        )
    return ranks


def _tensor_rows(md: DirMetadata) -> dict[str, dict[str, Any]]:
    """Per tensor, by name: dtype, global size, and where each chunk lies."""
    return {
        fqn: {
            "dtype": t.dtype,
            "size": list(t.size),
            "chunks": [
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "rank": c.rank,
                    "offset": c.offset,
                    "nbytes": c.nbytes,
                }
                for c in t.chunks
            ],
        }
        for fqn, t in sorted(md.tensors.items())
    }


def _print_inspection(
    path: str, local: str, md: DirMetadata, ranks: list[dict[str, Any]], tensors: dict[str, dict[str, Any]], size: Any
) -> None:
    total = sum(f.size for f in md.files) + os.path.getsize(os.path.join(local, METADATA_NAME))
    n_chunks = sum(len(t.chunks) for t in md.tensors.values())
    print(
        f"{path}: distributed checkpoint, world size {md.world_size} at save, DCP metadata {md.dcp_version}, "
        f"{size(total)}"
    )
    print(f"{'rank':>4}  {'file':<18} {'bytes':>12} {'chunks':>7}")
    for r in ranks:
        print(f"{r['rank']:>4}  {r['file']:<18} {r['size']:>12} {r['chunks']:>7}")
    print(f"{len(tensors)} tensors in {n_chunks} chunks:")
    for fqn, t in tensors.items():
        where = ", ".join(f"r{c['rank']}@{c['offsets']}" for c in t["chunks"])
        print(f"  {fqn:<40} {t['dtype']:<9} {t['size']}  {where}")
    print(f"{len(md.values)} non-tensor values: {', '.join(sorted(md.values))}")
    print("digests: not checked here (ckptkit verify checks every byte)")


def diff_directories(args: Any, tensor_lines: Callable[[list[dict[str, Any]]], list[str]]) -> int:
    """``diff A B --tensors`` for two distributed checkpoints: their logical tensors, bitwise,
    whatever the world size each was saved at (0 identical, 1 differences, 2 trouble)."""
    try:
        for p in (args.a, args.b):
            if not is_distributed_dir(p):
                raise CheckpointNotFound(f"{p}: not a distributed checkpoint directory; diff compares two of a kind")
        if not args.tensors:
            raise CheckpointError(
                "distributed checkpoints carry no config snapshot; compare their tensors with --tensors"
            )
        tensors = directory_tensor_diffs(args.a, args.b)
    except (CheckpointError, OSError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"ckptkit diff: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"schema_version": 1, "old": {"checkpoint": args.a}, "new": {"checkpoint": args.b}, "tensors": tensors},
                sort_keys=True,
                indent=2,
                ensure_ascii=True,
            )
        )
    else:
        print("\n".join([f"a: {args.a}", f"b: {args.b}", *tensor_lines(tensors)]))
    return 1 if tensors else 0


def directory_tensor_diffs(a: str, b: str) -> list[dict[str, Any]]:
    """The logical tensors of two distributed checkpoint directories that differ, bitwise."""
    from ..audit._compare import compare_states  # imports torch: only here
    from ..distributed._storage import logical_state

    out = []
    left, right = logical_state(a), logical_state(b)
    ka, va = next(left, (None, None))
    kb, vb = next(right, (None, None))
    while ka is not None or kb is not None:  # both in key order: one tensor of each side in memory at a time
        old = {ka: va} if ka is not None and (kb is None or ka <= kb) else {}
        new = {kb: vb} if kb is not None and (ka is None or kb <= ka) else {}
        out += [dataclasses.asdict(d) for d in compare_states(old, new)]
        if old:
            ka, va = next(left, (None, None))
        if new:
            kb, vb = next(right, (None, None))
    return out
