"""A training loop under ``SavePolicy.adaptive``: each manifest records why its step was saved."""

import time

from ckptflow import Checkpointer, SavePolicy, open_store
from ckptflow.catalog import checkpoints as catalog
from support.states import RUN, tiny_state, tiny_train


def test_every_save_records_its_decision_and_the_interval_follows_the_measurements(tmp_path):
    root, state = str(tmp_path), tiny_state()
    policy = SavePolicy.adaptive(max_overhead=0.5, initial_every=3, mtbf_s=0.2, full_every=2)
    with Checkpointer(root, RUN, policy=policy) as ckpt:
        for step in range(60):
            tiny_train(state)
            time.sleep(0.005)
            ckpt.save(step, state, blocking=step % 2 == 0)
    manifests = list(catalog.committed(open_store(root), RUN))
    decisions = [m.extra["save_decision"] for m in manifests]
    assert [d["step"] for d in decisions] == [m.step for m in manifests]
    assert decisions[0]["why"] == "nothing measured yet: the initial interval"
    assert manifests[1].step - manifests[0].step == 3  # the initial interval until measured
    later = decisions[2:]
    assert later and all(d["save_s"] > 0 and d["step_time_s"] > 0 for d in later)
    for before, after, decision in zip(manifests, manifests[1:], decisions[1:]):
        assert after.step - before.step == decision["every_steps"]  # saved exactly where it said
    assert [m.kind for m in manifests[:4]] == ["full", "incremental", "full", "incremental"]
