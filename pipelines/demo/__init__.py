"""`make demo`: a tiny LM trained with ckptflow checkpoints, a crash, a recovery, and
the Dagster lifecycle over its store (``python -m pipelines.demo``)."""

from pipelines.demo.model import DIM, SEQ, VOCAB, Batches, TinyLM, build, train_step

__all__ = ["DIM", "SEQ", "VOCAB", "Batches", "TinyLM", "build", "train_step"]
