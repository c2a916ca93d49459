"""Training-framework integrations, each an optional extra imported on its own:

- ``ckptflow.integrations.lightning``: ``CkptflowIO``, a PyTorch Lightning ``CheckpointIO``
  plugin (``pip install 'ckptflow[lightning]'``);
- ``ckptflow.integrations.hf``: ``CkptflowTrainer`` / ``CkptflowTrainerMixin`` for the
  Hugging Face ``transformers.Trainer`` (``pip install 'ckptflow[hf]'``).

Importing ``ckptflow`` never imports a framework.
"""
