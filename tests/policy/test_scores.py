"""``ckptflow.policy.scores``: which figure scores a commit, per metric."""

from ckptflow.policy.scores import scores


def test_per_metric_the_evaluation_then_the_trainer_record_then_the_metadata():
    metadata = {"train_loss": 0.5, "val_loss": 0.9, "acc": 0.1, "note": "x", "flag": True}
    records = {"trainer": {"metrics": {"val_loss": 0.8, "acc": 0.2}}, "evaluation": {"metrics": {"val_loss": 0.7}}}
    assert scores(metadata, records) == {"train_loss": 0.5, "val_loss": 0.7, "acc": 0.2}


def test_only_finite_numbers_score():
    records = {"evaluation": {"metrics": {"val_loss": float("nan"), "ppl": float("inf"), "ok": True}}}
    assert scores({"val_loss": 0.9}, records) == {"val_loss": 0.9}
    assert scores({}, {"trainer": {"metrics": None}, "evaluation": {}}) == {}
