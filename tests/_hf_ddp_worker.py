"""The Hugging Face example on several processes, each rank drawing its own random numbers, for
tests/integrations/test_hf_ddp.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/_hf_ddp_worker.py --output-dir OUT [--steps 8]

``examples/hf_finetune.py``'s Trainer with one callback: when training starts, each rank seeds its
global generators with ``seed + rank``. Trainer seeds every rank alike, so without it the ranks'
RNG states are equal at every checkpoint and a resume that gave every rank rank 0's states would
pass unnoticed; with it, each rank's dropout masks are its own and only its own saved states
continue them. Resumes the newest intact checkpoint, or starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import transformers
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from hf_finetune import leave, make_trainer, train


class SeedPerRank(TrainerCallback):
    """Each rank's generators from ``seed + rank``, after Trainer seeded them all alike (a resume
    then restores each rank's saved states over these, after skipping the resumed epoch's batches)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        transformers.set_seed(args.seed + args.process_index)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    o = p.parse_args()
    train(make_trainer(o.output_dir, steps=o.steps, callbacks=[SeedPerRank()]), o.output_dir)
    leave()  # the example's end: no interpreter shutdown for a gloo thread to abort


if __name__ == "__main__":
    main()
