"""``ckptkit inspect PATH``: what a checkpoint holds, without loading tensors (torch-free).

ckptkit inspect run/step-00000100.ckpt
ckptkit inspect run/step-00000100.ckpt --json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import CheckpointError, CheckpointNotFound
from ..format._container import check_flags, read_layout
from ..format._place import place_and_name, read_file
from ..format._section import TensorRef
from ..format._values import TypedValue
from ..format._verify import layout_report
from ..run._resume_check import verdict_line
from ._verify import _size, report_json

__all__ = ["URL_ARGS", "add_parser", "run"]

#: Arguments that may be ``s3://`` URLs (a committed checkpoint object, spec/objectstore.md).
URL_ARGS = ("path",)

_EPILOG = """\
example:
  $ ckptkit inspect run/step-00000100.ckpt
  run/step-00000100.ckpt: container v2, step 100, 1.2 MiB
  flags: fp32_fallback
  section   offset     bytes  codec  tensors
  model         56    834560  raw         26
  ...

Digests are not checked here; use `ckptkit verify`.
exit codes: 0 shown, 1 the file is malformed, 2 usage error or unreadable path
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's header, sections and flags",
        description="Show a checkpoint's version, step, flags, sections and what it lacks.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "path", metavar="PATH", help="a checkpoint file, or a Trainer checkpoint-N/ folder or output directory"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (schema_version 1)")


def _plain(tree: Any) -> Any:
    """A decoded tree with tensor references shown as placeholders."""
    if isinstance(tree, TensorRef):
        return f"<tensor {tree.id}>"
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    if isinstance(tree, dict):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, bytes):
        return tree.hex()
    if isinstance(tree, (set, frozenset)):  # no order of its own: shown in a fixed one
        return sorted((_plain(v) for v in tree), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(tree, TypedValue):
        return f"<{tree.name} {', '.join(map(str, tree.fields))}>"
    if type(tree).__module__ == "numpy":  # a typed value (spec/container.md §5.4): its type and shape, not its data
        return f"<numpy.{type(tree).__name__} {tree.dtype.str}{list(tree.shape)}>"
    return tree


def run(args: argparse.Namespace) -> int:
    from . import _distributed, _trainer

    if _distributed.is_distributed_dir(args.path):
        return _distributed.inspect_directory(args.path, args.json, _size)
    if _trainer.is_trainer_path(args.path):
        return _trainer.inspect(args.path, args.json, _size)
    if os.path.isdir(args.path):
        raise CheckpointNotFound(f"{args.path}: is a directory; inspect takes one checkpoint file")
    if args.path.rstrip("/").endswith(".dcp"):  # a distributed run's step, not a local directory (R-DC22)
        from ._remote import inspect_distributed

        return inspect_distributed(args.path, args.json, _size)
    with read_file(args.path) as src:
        layout = read_layout(src)
    if not layout.legacy:
        check_flags(layout)  # state this reader cannot restore is refused here as by load and verify
    report = layout_report(args.path, layout.size, layout, None, 0)  # no digest is checked here
    monitor = layout.sections.get("monitor")
    run_state = _plain(monitor.tree) if monitor is not None else None
    if args.json:
        out = report_json(report)
        del out["ok"], out["error"]
        out["schema_version"] = 1
        out["monitor"] = run_state
        out["rollback"] = _rollback_record(run_state)
        out["resumes"] = [{k: v for k, v in r.items() if k not in ("kind", "step")} for r in _resumes(args.path)]
        print(json.dumps(out, sort_keys=True))
        return 0
    print(f"{args.path}: container v{layout.version}, step {layout.step}, {_size(layout.size)}")
    print(f"flags: {', '.join(layout.flag_names) or '-'}")
    if layout.legacy:
        print(f"legacy: yes; this format cannot carry: {', '.join(layout.missing)}")
    print(f"{'section':<9} {'offset':>10} {'bytes':>12}  {'codec':<5} {'tensors':>8}")
    for s in report.sections:
        codec = s.codec or "-"
        status = "" if s.present else "  (absent)"
        print(f"{s.name:<9} {s.offset:>10} {s.length:>12}  {codec:<5} {s.tensors:>8}{status}")
    for line in _run_state_lines(run_state):
        print(line)
    for r in _resumes(args.path):
        print("run: " + (verdict_line(r) if r["verdict"] else f"resume at step {r['resumed_at']}: no verdict recorded"))
    print("digests: not checked here (ckptkit verify checks every byte)")
    return 0


def _resumes(path: str) -> tuple[dict[str, Any], ...]:
    """The verdict of each resume of the run the checkpoint is in (its ``history.jsonl``, R-D23)."""
    from ..run._history import HISTORY_FILE, check_history

    run = place_and_name(path)[0]
    try:
        if not run.bring(HISTORY_FILE):  # on a prefix: into the stage, where it is read as a local one
            return ()
        history = os.path.join(run.stage, HISTORY_FILE)
        return check_history(history).resumes if os.path.isfile(history) else ()
    except CheckpointError:
        return ()  # ckptkit verify reports a history it cannot read
    finally:
        run.close()


def _names(group: Any) -> str:
    return ", ".join(map(str, group)) if isinstance(group, dict) and group else "-"


def _run_state_lines(run_state: Any) -> list[str]:
    """The monitor section in words: data positions, monitors, values, companions, the rollback record.

    Shown as found (inspect shows damaged files too); other keys (a Lightning file's) are named.
    """
    if not isinstance(run_state, dict):
        return ["run state: none (no monitor section)"]
    data = run_state.get("data")
    lines = [
        "run state (monitor section):",
        "  data positions  "
        + (", ".join(f"{k}={v}" for k, v in data.items()) if isinstance(data, dict) and data else "-"),
        f"  monitors        {_names(run_state.get('monitors'))}",
        f"  values          {_names(run_state.get('values'))}",
        f"  companions      {_names(run_state.get('companions'))}",
    ]
    other = [str(k) for k in run_state if k not in ("data", "monitors", "values", "companions")]
    if other:
        lines.append(f"  other keys      {', '.join(other)}")
    rollback = _rollback_lines(run_state)
    return lines + (rollback or ["rollback: none recorded"])


def _rollback_record(run_state: Any) -> Any:
    """The trainer's spike-rollback record (``values.rollback``, spec/rollback.md R-R08), or None."""
    values = run_state.get("values") if isinstance(run_state, dict) else None
    return values.get("rollback") if isinstance(values, dict) else None


def _rollback_lines(run_state: Any) -> list[str]:
    """The rollback record in words; nothing for a checkpoint without one.

    Written defensively: inspect shows damaged files too, so a field of the wrong
    type is shown as it is rather than refused.
    """
    rec = _rollback_record(run_state)
    if not isinstance(rec, dict):
        return []
    head = (
        f"rollback: {rec.get('count')} rollback(s), lr scale {rec.get('lr_scale')}, "
        f"{rec.get('skipped_batches')} skipped batch(es), {rec.get('transient')} transient spike(s), "
        f"{rec.get('consecutive')} consecutive (until step {rec.get('horizon')} is passed)"
    )
    lines = [head]
    events = rec.get("rollbacks")
    for e in events if isinstance(events, list) else []:
        if not isinstance(e, dict):
            lines.append(f"  {e!r}")
            continue
        skipped = e.get("skipped")
        skip = (
            f"skipped data positions [{skipped.get('start')}, {skipped.get('end')}) ({skipped.get('batches')} batches)"
            if isinstance(skipped, dict)
            else "replayed the window"
        )
        lines.append(
            f"  step {e.get('step')} -> {e.get('to')}: {e.get('reason')}, grad norm {e.get('grad_norm')}, "
            f"median {e.get('median')}, ratio {e.get('ratio')}; lr {e.get('lr_before')} -> "
            f"{e.get('lr_after')}; {skip}"
        )
    return lines
