"""``ckptflow.policy.scores``: which figure scores a commit, per metric."""

from ckptflow.policy.scores import TRAINER, one_scale, scales, scores


def test_per_metric_the_evaluation_then_the_trainer_record_then_the_metadata():
    metadata = {"train_loss": 0.5, "val_loss": 0.9, "acc": 0.1, "note": "x", "flag": True}
    records = {"trainer": {"metrics": {"val_loss": 0.8, "acc": 0.2}}, "evaluation": {"metrics": {"val_loss": 0.7}}}
    assert scores(metadata, records) == {"train_loss": 0.5, "val_loss": 0.7, "acc": 0.2}


def test_only_finite_numbers_score():
    records = {"evaluation": {"metrics": {"val_loss": float("nan"), "ppl": float("inf"), "ok": True}}}
    assert scores({"val_loss": 0.9}, records) == {"val_loss": 0.9}
    assert scores({}, {"trainer": {"metrics": None}, "evaluation": {}}) == {}


def test_each_figure_is_on_its_scale_the_trainers_or_its_evaluators():
    metadata = {"val_loss": 0.9, "train_loss": 0.5}
    by_evaluator = {"evaluation": {"metrics": {"val_loss": 2.1}, "evaluator": "team.eval", "source": "evaluator"}}
    assert scales(metadata, by_evaluator) == {
        "val_loss": {TRAINER: 0.9, "team.eval's figures": 2.1},
        "train_loss": {TRAINER: 0.5},
    }
    from_trainer = {
        "trainer": {"metrics": {"val_loss": 0.8}},
        "evaluation": {"metrics": {"val_loss": 0.7}, "source": "trainer"},
    }
    assert scales(metadata, from_trainer)["val_loss"] == {TRAINER: 0.7}  # an evaluation of the trainer's figures


def test_candidates_rank_on_the_scale_most_of_them_were_scored_by_and_the_others_are_said():
    figures = {
        1: {TRAINER: 0.9, "a's figures": 2.1},
        2: {TRAINER: 0.4, "a's figures": 2.5},
        3: {TRAINER: 0.6, "b's figures": 1.0},
        4: {TRAINER: 0.5},
        5: {},
    }
    ranked, left_out = one_scale(figures)
    assert ranked == {1: 2.1, 2: 2.5}
    assert set(left_out) == {3, 4} and "not on a's figures" in left_out[3]
    assert one_scale({1: {"b's figures": 1.0}, 2: {"a's figures": 3.0}})[0] == {2: 3.0}  # a tie: the first by name
    assert one_scale({1: {TRAINER: 0.9}, 2: {TRAINER: 0.4}}) == ({1: 0.9, 2: 0.4}, {})
