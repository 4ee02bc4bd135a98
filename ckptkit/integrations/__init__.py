"""Plug-ins for other training engines, each in its own optional extra.

* :mod:`ckptkit.integrations.lightning` -- ``CheckpointIO`` for Lightning's ``Trainer``
  and ``Fabric`` (``pip install 'ckptkit[lightning]'``).
* :mod:`ckptkit.integrations.transformers` -- a Hugging Face ``Trainer`` whose checkpoints
  ckptkit commits, verifies and drift-checks (``pip install 'ckptkit[transformers]'``);
  :mod:`ckptkit.integrations.hf_folder` is its folder check, torch-free (``ckptkit verify``).
* :mod:`ckptkit.integrations.torchtitan` -- a ``CheckpointManager`` a torchtitan job config
  selects: ckptkit's DCP backend, the job config drift-checked on resume, no pickle
  (``pip install 'ckptkit[torchtitan]'``).

docs/integrations.md says how ckptkit is used with Lightning, torchtitan/DCP,
Hugging Face and experiment trackers.
"""
