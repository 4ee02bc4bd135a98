"""``ckptkit replay RUN --from STEP``: re-run a recorded run and name the first divergence.

    ckptkit replay runs/a --from 100
    ckptkit replay runs/a --from 100 --to 120 --json
    ckptkit replay runs/a --from 100 --out /tmp/replayed     # keep the replay's checkpoints
    ckptkit replay runs/a --from 100 --threads 1 --allow-env-change
    ckptkit replay runs/b --from 20 -- python train.py --run-dir {run_dir} --steps 40   # any loop

The logic is the one replay engine (``ckptkit.audit._commands.replay_command``), run on the
command after ``--`` or, without one, on the reference trainer (``ckptkit.trainer._replay``,
spec/replay.md); this module is its command line. RUN is only read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._copies import replay_from
from ._output import print_verdict
from ._progress import Progress

__all__ = ["URL_COPIES", "add_parser", "run"]

#: RUN on s3:// is read into a verified local copy: its checkpoint at or before --from, every
#: later one, environment.json and history.jsonl (spec/objectstore.md R-O43).
URL_COPIES = {"run_dir": lambda args: replay_from(args.run_dir, args.from_step)}

_EPILOG = """\
example:
  $ ckptkit replay runs/a --from 4
  replay: from the checkpoint at step 4 to step 8
  environment: torch 2.13.0+cpu, python 3.11.7, ..., deterministic_algorithms True, ...
  IDENTICAL: steps 4..7, every history fingerprint and 2 checkpoint(s) bit for bit (9 recorded rows)
  $ ckptkit replay runs/a --from 4 --perturb-at 5          # a deliberate 1-ulp change
  ...
  DIFFERS at step 5: the step row
    params_digest: the recording 12726245701552693584, the replay 4942022468468873759
    tensors that differ (1), first computed first:
      model:model.wte  1/16384 elements differ, max |diff| 9.31323e-10
    values: both runs' step-00000006.ckpt, compared as ckptkit diff --tensors does
    re-run of step 5 twice here: identical (deterministic in this process)
    hint: the runs' configs differ in testing.perturb_at: the likely cause
  $ echo $?
  1

The replay is `ckptkit train --resume` (torchrun with as many ranks for a torchrun run) in a
fresh process, from a copy of RUN's checkpoint at or before --from, compared row by row and
checkpoint by checkpoint with RUN's recording (spec/replay.md).
Any trainer flag below overrides the value in the checkpoint's config snapshot (the
override is printed with the result); --no-perturb clears the --perturb-at testing aid.

any loop: after --, the command that made RUN, with {run_dir} where its run directory goes.
RUN's checkpoint at (or before) --from, its companions and history.jsonl are copied into a fresh
directory; the command resumes from it (state.resume_or_start()) and what it records and saves
is compared with RUN's. --timeout bounds it (default 600 s).

exit codes:
  0  every replayed step matched the recording bit for bit
  1  divergence (step, fingerprint, tensors named), a checkpoint altered after the fact,
     or the environment differs from the recording (without --allow-env-change)
  2  trouble: no such run, no checkpoint at or before --from, --to outside the recording"""


def add_parser(sub: Any) -> None:
    """``ckptkit replay``'s flags, kept as one function: a flag table reads best as one list, in ``--help`` order."""
    from ._train import add_knobs  # the trainer's flags, one per config key: reused, not copied

    p = sub.add_parser(
        "replay",
        help="re-run a recorded run from a checkpoint; name the first step and tensor that diverge",
        description="Re-run RUN from its checkpoint at (or nearest before) --from and compare every step's "
        "fingerprints with history.jsonl; on the first difference, name the step, the fingerprint "
        "and the tensors that differ, and re-run that step twice to tell nondeterminism here from a "
        "difference with the recording. RUN is only read.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN", help="the recorded run directory, or s3://bucket/prefix")
    g = p.add_argument_group("replay")
    g.add_argument(
        "--from",
        dest="from_step",
        type=int,
        required=True,
        metavar="STEP",
        help="start at the checkpoint at or nearest before this step (steps done)",
    )
    g.add_argument(
        "--to",
        dest="to_step",
        type=int,
        default=None,
        metavar="STEP",
        help="stop when this many steps are done (default: the end of the recording)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object (schema_version 2, the audit's)")
    g.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="keep the replay's checkpoints here (an empty directory outside RUN), for "
        "`ckptkit diff --tensors RUN/step-N.ckpt DIR/step-N.ckpt`",
    )
    g.add_argument(
        "--allow-env-change",
        action="store_true",
        help="replay even when the environment differs from RUN/environment.json (listed with the result)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="run with N intra-op threads (an environment change: needs --allow-env-change unless "
        "the recording used N)",
    )
    g.add_argument("--no-perturb", action="store_true", help="TESTING AID: replay without the recording's --perturb-at")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no progress lines on stderr")
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the most the replaying process may take (default 600)",
    )
    add_knobs(p)


def run(args: argparse.Namespace) -> int:
    from ..trainer._config import knobs

    if args.cmd:  # any loop: the command that made RUN
        from ..audit._commands import ReplayPlan, replay_command

        with Progress("replay", quiet=args.quiet) as progress:
            try:
                plan = ReplayPlan(
                    run_dir=args.run_dir,
                    from_step=args.from_step,
                    command=args.cmd,
                    timeout=args.timeout,
                    keep_dir=args.out,
                    log=progress.log,
                )
            except ValueError as e:  # --timeout
                print(f"ckptkit replay: {e}", file=sys.stderr)
                return 2
            outcome = replay_command(plan)
        return print_verdict(outcome, args.json)
    from ..trainer._replay import replay

    overrides = {key: getattr(args, key) for key, _ in knobs() if getattr(args, key, None) is not None}
    overrides.pop("train.steps", None)  # --to says where to stop
    if args.no_perturb:
        overrides["testing.perturb_at"] = None
    if args.threads is not None and args.threads < 1:
        print(f"ckptkit replay: --threads must be >= 1 (got {args.threads})", file=sys.stderr)
        return 2
    try:
        with Progress("replay", quiet=args.quiet) as progress:
            report = replay(
                args.run_dir,
                args.from_step,
                args.to_step,
                overrides=overrides,
                allow_env_change=args.allow_env_change,
                threads=args.threads,
                out_dir=args.out,
                timeout=args.timeout,
                log=progress.log,
                on_step=progress.at,
            )
    except ValueError as e:  # an override the config refuses
        if getattr(args, "debug", False):
            raise
        print(f"ckptkit replay: {e}", file=sys.stderr)
        return 2
    return print_verdict(report, args.json)
