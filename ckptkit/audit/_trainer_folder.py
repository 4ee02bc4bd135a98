"""A Hugging Face ``Trainer`` checkpoint folder as the state the audit compares (spec/transformers.md R-HF09).

Two runs of one experiment write ``checkpoint-N/`` folders whose bytes differ where no state
does: the config snapshot holds the exempt ``output_dir`` (and ``logging_dir``), the commit's
file record holds the snapshot's digest, and ``trainer_state.json``'s log averages the loss
since the last log, which a resume restarts. So a folder is compared by what a resume
restores from it: the weights, the commit's optimizer, scheduler, scaler and RNG states, and in a
multi-process run each other rank's RNG states (its own container in the folder, R-HF11).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import FormatError
from ..format._checkpoint import load
from ..format._tree import checkpoint_state
from ..run._files import TRAINER_COMMIT

__all__ = ["folder_state", "is_trainer_folder"]

_RESTORED = ("optim:", "monitor:rng.")  # the commit's sections a resume restores (R-HF02)


def is_trainer_folder(path: str) -> bool:
    """A committed ``checkpoint-N/`` folder (it holds the commit)."""
    return os.path.isfile(os.path.join(path, TRAINER_COMMIT))


def folder_state(folder: str) -> dict[str, Any]:
    """The state a resume restores from ``folder``, flattened: each ``*.safetensors`` file's
    tensors as ``<file>:<name>``, the commit's ``optim:*`` and ``monitor:rng.*`` leaves, and each
    other container's (a rank's RNG file) ``monitor:rng.*`` leaves as ``<file>:monitor:rng.*``.

    Raises:
        FormatError: the commit does not verify, or a weights file cannot be read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {
        k: v for k, v in checkpoint_state(load(os.path.join(folder, TRAINER_COMMIT))).items() if k.startswith(_RESTORED)
    }
    for name in sorted(os.listdir(folder)):
        if name.endswith(".ckpt") and name != TRAINER_COMMIT:
            rank = checkpoint_state(load(os.path.join(folder, name)))
            state.update((f"{name}:{k}", v) for k, v in rank.items() if k.startswith("monitor:rng."))
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            try:
                tensors = load_file(path)
            except (SafetensorError, OSError) as e:
                raise FormatError(
                    f"not a readable safetensors file ({e})", path=path, hint="ckptkit verify names the damage"
                ) from None
            state.update((f"{name}:{key}", t) for key, t in tensors.items())
    return state
