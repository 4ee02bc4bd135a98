"""Plug-ins for other training engines, each in its own optional extra.

* :mod:`ckptkit.integrations.lightning` -- ``CheckpointIO`` for Lightning's ``Trainer``
  and ``Fabric`` (``pip install 'ckptkit[lightning]'``).

docs/integrations.md says how ckptkit is used with Lightning, torchtitan/DCP,
Hugging Face and experiment trackers.
"""
