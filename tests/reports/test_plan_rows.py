"""The retention plan as a table: each checkpoint's action and why, and the fate of each copy."""

from ckptflow.policy.retention import RetentionPlan
from ckptflow.reports.inventory import Entry, plan_rows

ARCHIVED = {"archive": {"ok": True}}


def test_each_copy_has_its_fate_and_retention_never_expires_an_archive_copy():
    entries = [
        Entry("r", 1, tiers=["hot", "archive"], records=ARCHIVED),  # archive only from now on
        Entry("r", 2, tiers=["hot", "archive"], records=ARCHIVED),  # deleted: its archive copy stays
        Entry("r", 3, tiers=["hot"]),  # deleted for good
        Entry("r", 4, tiers=["hot", "archive"], records={"archive": {"ok": False}}),  # a copy that did not verify
    ]
    plan = RetentionPlan(
        keep={("r", 1): ["best val_loss"], ("r", 4): ["newest", "pinned"]},
        delete={("r", 2): "older than 30 days", ("r", 3): "older than 30 days"},
        archive_only={("r", 1): "older than 7 days"},
    )
    assert plan_rows(entries, plan) == [
        {"run": "r", "step": 1, "action": "archive only", "hot": "expire", "archive": "keep",
         "why": "older than 7 days; best val_loss"},
        {"run": "r", "step": 4, "action": "keep", "hot": "keep", "archive": "-", "why": "newest; pinned"},
        {"run": "r", "step": 2, "action": "delete", "hot": "expire", "archive": "keep", "why": "older than 30 days"},
        {"run": "r", "step": 3, "action": "delete", "hot": "expire", "archive": "-", "why": "older than 30 days"},
    ]  # fmt: skip


def test_an_empty_plan_has_no_rows():
    assert plan_rows([], RetentionPlan(keep={}, delete={})) == []
