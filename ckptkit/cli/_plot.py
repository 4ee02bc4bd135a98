"""``ckptkit plot RUN -o FILE.png``: draw a run's recording (needs ``pip install 'ckptkit[plot]'``).

ckptkit plot runs/a -o runs/a.png
ckptkit plot runs/a -o zoom.png --from 180 --to 220
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ._copies import no_step

__all__ = ["URL_COPIES", "add_parser", "run"]

#: RUN on s3:// is read into a local copy of its history.jsonl (spec/objectstore.md R-O43).
URL_COPIES = {"run": lambda _args: no_step}

_EPILOG = """\
example:
  $ ckptkit train --run-dir runs/b --steps 300 --auto-rollback on --spike-at 200
  $ ckptkit plot runs/b -o runs/b.png
  runs/b.png: 313 step rows, 2 spike(s), 1 rollback(s), 0 resume(s); drew abandoned:grad_norm, ...

panels: loss and its parts (every loss* / *_loss field of the step rows); grad norm with
the spike threshold (the run's --spike-multiplier x rolling median, recomputed with ckptkit's
detector) and spike markers; the LR with its drops. Rollbacks are shaded from step N back to
the step T the run restarted from (abandoned rows faded), resumes are dotted lines.
Works on any history.jsonl: the reference trainer's or an outside loop's recording.

exit codes: 0 written, 2 usage error, unreadable run, nothing to plot, or matplotlib missing
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plot",
        help="draw loss, grad norm, spikes, rollbacks, LR and resumes of a run to an image",
        description="Draw a run's history.jsonl: loss (and its parts), grad norm against the spike threshold, "
        "spikes, rollbacks, the LR and resumes. Needs matplotlib: pip install 'ckptkit[plot]'.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", metavar="RUN", help="a run directory (or its history.jsonl), or s3://bucket/prefix")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the image to write; its suffix picks the format (.png, .svg, .pdf)",
    )
    p.add_argument("--from", dest="start", type=int, default=None, metavar="STEP", help="first step drawn")
    p.add_argument("--to", dest="end", type=int, default=None, metavar="STEP", help="last step drawn")
    p.add_argument("--json", action="store_true", help="print what was drawn as one JSON object (schema_version 1)")


def run(args: argparse.Namespace) -> int:
    from ..audit._plot import PLOT_EXTRA, plot_run
    from ..errors import CheckpointError

    if args.start is not None and args.end is not None and args.start > args.end:
        print(f"ckptkit plot: --from {args.start} is after --to {args.end}", file=sys.stderr)
        return 2
    try:
        summary = plot_run(args.run, args.output, start=args.start, end=args.end)
    except CheckpointError:
        raise  # the CLI's one-line error with its exit code
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        print(f"ckptkit plot: matplotlib is not installed: {PLOT_EXTRA}", file=sys.stderr)
        return 2
    except ValueError as e:  # nothing in the range; an image format matplotlib does not write
        print(f"ckptkit plot: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"schema_version": 1, **dataclasses.asdict(summary)}, sort_keys=True))
    else:
        print(summary.describe())
    return 0
