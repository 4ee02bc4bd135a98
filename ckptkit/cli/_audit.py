"""``ckptkit audit``: is training deterministic here? Train twice, compare bit for bit.

    ckptkit audit                           # two 10-step runs, each in a fresh process
    ckptkit audit --resume-at 4             # uninterrupted vs stopped at 4 + resumed in a fresh process
    ckptkit audit --steps 20 --quant int8 --rand-depth --keep-dir /tmp/audit --json
    ckptkit audit --nproc-per-node 2 --resume-at 4   # each run a 2-rank torchrun job
    ckptkit audit -- python examples/resumable_loop.py --run-dir {run_dir} --steps 40   # any loop
    ckptkit audit --stop-at 17 --timeout 120 -- python train.py --run-dir {run_dir}

The logic is ``ckptkit.trainer._audit`` (spec/replay.md R-P11..R-P13); this module is
its command line. The trainer's flags are the train command's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ._output import print_verdict
from ._progress import Progress

__all__ = ["add_parser", "run"]

_EPILOG = """\
example:
  $ ckptkit audit --resume-at 4
  audit: a: 10 steps uninterrupted; b: cooperative stop at step 4, resumed in a fresh process
  environment: torch 2.13.0+cpu, python 3.11.7, numpy 2.3.5, intra_op_threads 2, ...
  IDENTICAL: 10 steps, every history fingerprint and 10 checkpoint(s) bit for bit (22 recorded rows)

Defaults differ from `ckptkit train` in three knobs, unless given: --steps 10,
--ckpt-every 1 (a checkpoint after every step, so a divergence has values on both
sides), --keep steps+1 (all of them kept).

any loop: after --, your command with {run_dir} where its run directory goes. It runs once
uninterrupted (a) and once stopped at --stop-at K (default: half its end) and resumed in a new
process with the same arguments (b). The command must use ckptkit.RunState on {run_dir} and start
with state.resume_or_start(). The stop request is CKPTKIT_STOP_AT=K: state.step_done(step + 1)
after every step takes it (a cooperative stop at exactly K); a command that ignores it is killed
(SIGKILL, as a crash) once it has committed a checkpoint at or after K and gone on, and the report
says "killed after checkpoint N". state.record(step, loss=...) lets the report name the first step:
  $ ckptkit audit -- python examples/resumable_loop.py --run-dir {run_dir} --steps 40
  audit: a: 40 steps uninterrupted; b: cooperative stop at step 20, resumed in a fresh process
  environment: torch 2.13.0+cpu, python 3.11.7, numpy 2.3.5, intra_op_threads 2, ...
  IDENTICAL: 40 steps, every history fingerprint and 1 checkpoint(s) bit for bit (80 recorded rows)

exit codes:
  0  the two runs are bit-identical (history fingerprints and checkpoint bytes)
  1  they differ: the first step, fingerprint and tensors are named
  2  trouble: a usage error, a training process failed or timed out (--timeout), a command that
     saves no checkpoint, or that ignores the stop request and saves none at or after --stop-at
     before its end, --stop-at outside the run"""


def add_parser(sub: Any) -> None:
    """``ckptkit audit``'s flags, kept as one function: a flag table reads best as one list, in ``--help`` order."""
    from ._train import add_knobs  # the trainer's flags, one per config key: reused, not copied

    p = sub.add_parser(
        "audit",
        help="train the same short run twice (or stopped and resumed) and check it is bit-identical",
        description="Train the same config twice, each in a fresh process, and compare the runs bit for bit "
        "(history fingerprints, then checkpoint bytes). With --resume-at K the second run stops at "
        "K and is resumed in another fresh process. The environment (environment.json) is shown, "
        "and any fact that differs between the runs is listed.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("audit")
    g.add_argument(
        "--resume-at",
        type=int,
        default=None,
        metavar="K",
        help="the second run stops after K steps and is resumed in a fresh process",
    )
    g.add_argument(
        "--keep-dir",
        metavar="DIR",
        default=None,
        help="keep the two runs in DIR/a and DIR/b (an empty or new directory); default: a temporary one",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="ranks per run: each training process is a torchrun job of N ranks (spec/trainer.md R-T14; default 1)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object (schema_version 1)")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no progress lines on stderr")
    g.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="K",
        help="with -- CMD: run b stops after K steps, or is killed after a checkpoint >= K (default: half a's end)",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with -- CMD: the most each process may take (default 600)",
    )
    from ..trainer._audit import AUDIT_DEFAULTS

    add_knobs(p, shown={**AUDIT_DEFAULTS, "train.keep": "steps+1"})


def config_for_audit(args: argparse.Namespace) -> Any:
    """The train flags' config, with the audit's defaults for the knobs not given.

    Raises:
        ValueError: a value breaks a field's rule.
    """
    from ..trainer._audit import AUDIT_DEFAULTS
    from ..trainer._config import knobs
    from ._train import config_from_args

    given = {key for key, _ in knobs() if getattr(args, key, None) is not None}
    cfg = config_from_args(args)
    cfg = cfg.replace(**{k: v for k, v in AUDIT_DEFAULTS.items() if k not in given})
    if "train.keep" not in given:
        cfg = cfg.replace(**{"train.keep": cfg.train.steps + 1})
    return cfg


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..trainer._audit import audit

    command = args.cmd
    if command or args.stop_at is not None:
        return _run_command(args, command)

    try:
        cfg = config_for_audit(args)
        if args.keep_dir is not None and os.path.isdir(args.keep_dir) and os.listdir(args.keep_dir):
            raise ValueError(f"--keep-dir {args.keep_dir} is not empty")
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1 (got {args.nproc_per_node})")
        with Progress("audit", quiet=args.quiet) as progress:
            report = audit(
                cfg,
                args.keep_dir,
                resume_at=args.resume_at,
                nproc=args.nproc_per_node,
                log=progress.log,
                on_step=progress.at,
            )
    except CheckpointError:
        raise  # the dispatcher prints it (AuditError: exit 2)
    except ValueError as e:  # a config the trainer refuses, a non-empty --keep-dir
        if getattr(args, "debug", False):
            raise
        print(f"ckptkit audit: {e}", file=sys.stderr)
        return 2
    return print_verdict(report, args.json)


def _run_command(args: argparse.Namespace, command: list[str]) -> int:
    """``ckptkit audit [--stop-at K] -- CMD ARGS...``: any loop (ckptkit.audit._commands)."""
    from ..audit._commands import AuditPlan, audit_command
    from ..trainer._config import knobs

    given = [key for key, _ in knobs() if getattr(args, key, None) is not None]
    if given or args.resume_at is not None:
        print(
            "ckptkit audit: the trainer's flags (and --resume-at) audit `ckptkit train`; with -- CMD the "
            "command has its own arguments (use --stop-at K)",
            file=sys.stderr,
        )
        return 2
    if args.nproc_per_node != 1:
        print(
            "ckptkit audit: --nproc-per-node starts `ckptkit train` under torchrun; with -- CMD put torchrun "
            "in the command itself (-- torchrun --nproc_per_node 2 train.py --run-dir {run_dir})",
            file=sys.stderr,
        )
        return 2
    with Progress("audit", quiet=args.quiet) as progress:
        try:
            plan = AuditPlan(
                command=command, stop_at=args.stop_at, timeout=args.timeout, keep_dir=args.keep_dir, log=progress.log
            )
        except ValueError as e:  # --timeout
            print(f"ckptkit audit: {e}", file=sys.stderr)
            return 2
        report = audit_command(plan)
    return print_verdict(report, args.json)
