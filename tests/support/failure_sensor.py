"""The failure sensor's runs and records in tests: a tick, a failed evaluation of step 40,
its failure record, and why the checkpoint needs attention."""

from dagster import build_sensor_context, materialize

from assets import PARTITIONED, checkpoint_key, evaluation
from ckptflow import lifecycle
from ckptflow.catalog.verdicts import Subject
from ckptflow.reports import inventory, recoverable
from ckptflow.store import open_store
from resources import EvaluatorResource
from sensors import failure_sensor
from support.dagster import RUN

KEY = checkpoint_key(RUN, 40)


def tick(instance, resources, cursor=None):
    with build_sensor_context(instance=instance, cursor=cursor, resources={"store": resources["store"]}) as context:
        failure_sensor(context)
        return context.cursor


def failure(store: str, digest: str) -> dict | None:
    return lifecycle.read_record(open_store(store), Subject(RUN, 40, digest), "failure")


def needs_attention(store: str) -> str | None:
    """Why step 40 needs an operator (``recoverability``'s reason), or None."""
    [entry] = [e for e in inventory.collect(open_store(store)) if e.step == 40]
    return recoverable.attention_reason(entry)


def evaluation_failed(instance, resources):
    """A run of ``evaluation`` in partition KEY that fails (its evaluator cannot be loaded)."""
    instance.add_dynamic_partitions("checkpoints", [KEY])
    broken = {**resources, "evaluator": EvaluatorResource(evaluators={RUN: "no.such.module:evaluate"})}
    return materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=broken, selection=[evaluation],
        raise_on_error=False,
    )  # fmt: skip
