"""``ckptkit diff A B``: what differs between two runs' config snapshots (spec/snapshot.md).

    ckptkit diff runs/a runs/b
    ckptkit diff runs/a/step-00000120.ckpt runs/b/step-00000120.ckpt --json
    ckptkit diff a.config.json b.config.json

A and B are snapshot files (``*.config.json``), checkpoints (the snapshot next
to it, ``<ckpt>.config.json``) or run directories (the snapshot next to the
newest ``step-XXXXXXXX.ckpt`` or ``step-XXXXXXXX.dcp/``, else ``config.json`` at the
directory root), or a Hugging Face Trainer ``checkpoint-N/`` folder or output directory
(its newest folder's ``ckptkit.config.json``; spec/transformers.md), or a file the
Lightning plug-in wrote (its hyper-parameters are the config; spec/lightning.md R-L05).
A is the old side, B the new one: the classes are the ones a resume of A with
B's config would see (no declared defaults are filled in: what is written is
compared). Exit codes as GNU diff: 0 no strict difference, 1 strict drift (or
differing tensors with ``--tensors``), 2 trouble.

Imports no torch unless ``--tensors`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound, FormatError
from ..format._snapshot import SNAPSHOT_SUFFIX, Snapshot, read_snapshot, snapshot_path
from ..run._drift import DEFAULT_EXEMPT, KeyDiff, diff_keys
from ..run._files import list_checkpoints
from ._copies import newest_step

__all__ = ["URL_COPIES", "add_parser", "run"]

#: A and B on s3:// are read into verified local copies: a run prefix's newest committed
#: checkpoint and config.json, or the checkpoint an object URL names (spec/objectstore.md R-O43).
URL_COPIES = {"a": lambda _args: newest_step, "b": lambda _args: newest_step}

JSON_SCHEMA_VERSION = 1
"""``schema_version`` of the ``--json`` output object."""

_RUN_CONFIG = "config.json"

_DESCRIPTION = """\
Compare the config snapshots of two runs key by key and class each difference:
strict (a resume would be refused: ConfigDrift) or exempt (steps, log_every,
ckpt_every, eval, eval_every: they decide when we look, not what the model
computes).

A and B may each be
  a snapshot file          runs/a/step-00000120.ckpt.config.json
  a checkpoint             runs/a/step-00000120.ckpt  (uses <ckpt>.config.json)
  a run directory          runs/a  (the snapshot of the newest step-*.ckpt
                           or step-*.dcp/, else runs/a/config.json)
  a Lightning file         epoch=1-step=20.ckpt written by ckptkit's plug-in
                           (its hyper_parameters are compared as the config)
  a Trainer folder         out/checkpoint-20, or out (its newest checkpoint-N/);
                           the exempt class is then the Trainer's (spec/transformers.md)
  any of these on S3       s3://bucket/run, s3://bucket/run/step-00000120.ckpt: read into a
                           verified local copy first (docs/storage.md)
A is the old side, B the new one."""

_EPILOG = """\
example:
  $ ckptkit diff runs/a runs/b
  a: runs/a/step-00000010.ckpt.config.json
  b: runs/b/step-00000010.ckpt.config.json
  CLASS   KEY          OLD    NEW    NOTE
  strict  train.lr     0.001  0.002
  exempt  train.steps  10     20     extending the run
  2 differences: 1 strict, 1 exempt
  $ echo $?
  1

exit codes:
  0  no strict difference (exempt ones may be listed)
  1  strict drift (with --tensors: or tensors that differ)
  2  trouble: a path is missing, not a snapshot, or unreadable"""


def add_parser(subparsers: Any) -> None:
    """Register ``diff`` on an ``argparse`` sub-parsers object."""
    p = subparsers.add_parser(
        "diff",
        help="compare two runs' config snapshots (strict vs exempt keys)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("a", metavar="A", help="old side: snapshot, checkpoint or run directory (or s3://...)")
    p.add_argument("b", metavar="B", help="new side: snapshot, checkpoint or run directory (or s3://...)")
    p.add_argument("--json", action="store_true", help="print one JSON object (with schema_version) instead of a table")
    p.add_argument(
        "--tensors",
        action="store_true",
        help="also compare the two checkpoints' tensors, bitwise (needs checkpoints or run directories)",
    )


class _Unavailable(Exception):
    """``--tensors`` cannot run here; exit 2 (private: never leaves :func:`run`)."""


def _newest_checkpoint(directory: str) -> str | None:
    files = [(step, path) for step, path in list_checkpoints(directory) if os.path.isfile(path)]
    return max(files)[1] if files else None


def _side(path: str) -> tuple[Snapshot, str | None]:
    """(the config snapshot, the checkpoint or None) of one side: a Lightning plug-in file's
    hyper-parameters stand for its config (spec/lightning.md R-L05)."""
    named_config = path.endswith(SNAPSHOT_SUFFIX) or os.path.basename(path) == _RUN_CONFIG
    if os.path.isfile(path) and not named_config and not os.path.isfile(snapshot_path(path)):
        from ..integrations.lightning_file import hyper_parameters
        from ._inspect_cmd import _plain

        try:
            hparams = hyper_parameters(path)
        except FormatError:  # not a container: said below as a missing snapshot
            hparams = None
        if hparams is not None:
            return Snapshot(
                _plain(hparams), "lightning hyper_parameters", path=f"{path} (Lightning hyper_parameters)"
            ), path
    snap, ckpt = _resolve(path)
    return read_snapshot(snap), ckpt


def _newest_dcp(path: str) -> tuple[str, str | None] | None:
    """(snapshot, step directory) for a distributed run directory (its newest ``step-N.dcp/``) or a
    step directory with a snapshot beside it; None for anything else."""
    from . import _distributed

    if _distributed.is_distributed_dir(path):
        snap = snapshot_path(path.rstrip(os.sep))
        return (snap, path) if os.path.isfile(snap) else None
    steps = _distributed.run_contents(path)[0] if os.path.isdir(path) else []
    if not steps:
        return None
    snap = snapshot_path(steps[-1])
    if not os.path.isfile(snap):
        raise CheckpointNotFound(f"{steps[-1]}: the newest checkpoint has no config snapshot (expected {snap})")
    return snap, steps[-1]


def _resolve(path: str) -> tuple[str, str | None]:
    """(snapshot file, checkpoint or None) for a command-line path."""
    from . import _trainer

    trainer = _trainer.snapshot_of(path) or _newest_dcp(path)
    if trainer is not None:
        return trainer
    if os.path.isdir(path):
        ckpt = _newest_checkpoint(path)
        if ckpt is not None:
            snap = snapshot_path(ckpt)
            if not os.path.isfile(snap):
                raise CheckpointNotFound(f"{ckpt}: the newest checkpoint has no config snapshot (expected {snap})")
            return snap, ckpt
        root = os.path.join(path, _RUN_CONFIG)
        if os.path.isfile(root):
            return root, None
        raise CheckpointNotFound(f"{path}: no step-XXXXXXXX.ckpt and no {_RUN_CONFIG} in this run directory")
    if not os.path.exists(path):
        raise CheckpointNotFound(f"{path}: no such file or directory")
    if path.endswith(SNAPSHOT_SUFFIX) or os.path.basename(path) == _RUN_CONFIG:
        ckpt = path[: -len(SNAPSHOT_SUFFIX)] if path.endswith(SNAPSHOT_SUFFIX) else ""
        return path, ckpt if ckpt and os.path.isfile(ckpt) else None
    snap = snapshot_path(path)
    if not os.path.isfile(snap):
        raise CheckpointNotFound(f"{path}: no config snapshot next to this checkpoint (expected {snap})")
    return snap, path


def _trainer_pair(a: Snapshot, b: Snapshot) -> bool:
    """Both sides are Hugging Face Trainer snapshots (spec/transformers.md)."""
    from ..integrations.hf_folder import CONFIG_TYPE

    return a.config_type == b.config_type == CONFIG_TYPE


def _exempt(a: Snapshot, b: Snapshot) -> frozenset[str]:
    """The exempt class a resume would apply: a Trainer run's (spec/transformers.md R-HF04), else the default."""
    from ..integrations.hf_folder import EXEMPT

    return EXEMPT if _trainer_pair(a, b) else DEFAULT_EXEMPT


def _set_aside(tensors: list[dict[str, Any]], a: Snapshot, b: Snapshot) -> tuple[list[dict[str, Any]], list[str]]:
    """(the tensor differences that count, notes): a Trainer commit records its snapshot file's size and
    digest, and the snapshot is compared key by key above, so that record is said, not counted (R-HF10)."""
    from ..integrations.hf_folder import CONFIG_FILE

    if not _trainer_pair(a, b):
        return tensors, []
    name = f"monitor:files.{CONFIG_FILE}"
    record = [t for t in tensors if t["name"].startswith(f"{name}.")]
    if not record:
        return tensors, []
    note = f"exempt: {name} (the snapshot file's size and digest: its keys are compared above)"
    return [t for t in tensors if t not in record], [note]


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=True)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _config_lines(a: Snapshot, b: Snapshot, diffs: list[KeyDiff]) -> list[str]:
    lines = [f"a: {a.path}", f"b: {b.path}"]
    if a.config_type != b.config_type:
        lines.append(f"config_type: {a.config_type} -> {b.config_type} (informational, not compared)")
    if not diffs:
        return [*lines, "no differences"]
    rows = [["CLASS", "KEY", "OLD", "NEW", "NOTE"]]
    for d in diffs:
        rows.append(
            [
                "exempt" if d.exempt else "strict",
                d.key,
                "-" if d.kind == "only_new" else _show(d.old),
                "-" if d.kind == "only_old" else _show(d.new),
                d.note,
            ]
        )
    strict = sum(d.strict for d in diffs)
    n = len(diffs)
    lines += _table(rows)
    lines.append(f"{n} difference{'s' if n != 1 else ''}: {strict} strict, {n - strict} exempt")
    return lines


def _diff_json(d: KeyDiff) -> dict[str, Any]:
    out: dict[str, Any] = {"key": d.key, "kind": d.kind, "class": "exempt" if d.exempt else "strict"}
    if d.kind != "only_new":
        out["old"] = d.old
    if d.kind != "only_old":
        out["new"] = d.new
    return out


# --- --tensors ----------------------------------------------------------------------


def _tensor_diffs(ckpt_a: str | None, ckpt_b: str | None) -> list[dict[str, Any]]:
    if ckpt_a is None or ckpt_b is None:
        raise _Unavailable("--tensors needs two checkpoints (or run directories that hold one), not bare snapshots")
    if os.path.isdir(ckpt_a) or os.path.isdir(ckpt_b):
        from . import _distributed

        if not (os.path.isdir(ckpt_a) and os.path.isdir(ckpt_b)):
            raise _Unavailable(
                f"--tensors compares two of a kind: {ckpt_a if os.path.isdir(ckpt_a) else ckpt_b} is a distributed "
                "checkpoint directory and the other side a checkpoint file"
            )
        return _distributed.directory_tensor_diffs(ckpt_a, ckpt_b)
    from ..audit._compare import compare_checkpoints  # imports torch: only when asked

    return [dataclasses.asdict(d) for d in compare_checkpoints(ckpt_a, ckpt_b)]


def _tensor_lines(tensors: list[dict[str, str]]) -> list[str]:
    if not tensors:
        return ["tensors: bitwise identical"]
    rows = [["KIND", "TENSOR", "DETAIL"]] + [[t["kind"], t["name"], t["detail"]] for t in tensors]
    n = len(tensors)
    return [f"tensors: {n} difference{'s' if n != 1 else ''}", *_table(rows)]


def run(args: argparse.Namespace) -> int:
    """Run ``ckptkit diff``; return the exit code (0 clean, 1 strict drift, 2 trouble).

    Results go to stdout; a problem with a path is one line on stderr (exit 2).
    With ``args.debug`` set, ckptkit errors are re-raised instead.
    """
    from . import _distributed

    bare = [p for p in (args.a, args.b) if _distributed.is_distributed_dir(p) and _newest_dcp(p) is None]
    if bare:  # a ckptkit.distributed.save directory: no config snapshot, tensors only
        return _distributed.diff_directories(args, _tensor_lines)
    try:
        a, ckpt_a = _side(args.a)
        b, ckpt_b = _side(args.b)
        diffs = diff_keys(a, b, exempt=_exempt(a, b))
        tensors, notes = _set_aside(_tensor_diffs(ckpt_a, ckpt_b), a, b) if args.tensors else (None, [])
    except (CheckpointError, OSError, _Unavailable) as e:
        if getattr(args, "debug", False):
            raise
        print(f"ckptkit diff: {e}", file=sys.stderr)
        return 2

    strict = sum(d.strict for d in diffs)
    if args.json:
        doc: dict[str, Any] = {
            "schema_version": JSON_SCHEMA_VERSION,
            "old": {"path": a.path, "config_type": a.config_type, "checkpoint": ckpt_a},
            "new": {"path": b.path, "config_type": b.config_type, "checkpoint": ckpt_b},
            "differences": [_diff_json(d) for d in diffs],
            "strict": strict,
            "exempt": len(diffs) - strict,
        }
        if tensors is not None:
            doc["tensors"], doc["notes"] = tensors, notes
        print(json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=True))
    else:
        lines = _config_lines(a, b, diffs)
        if tensors is not None:
            lines += _tensor_lines(tensors) + notes
        print("\n".join(lines))
    return 1 if strict or tensors else 0
