"""Which tier one checkpoint is read from: the hot copy, else the archive's, else the hot
store (so reading it says why); the archive is opened only when the hot copy is gone."""

import os

import pytest

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog.tiers import holds_commit, source_tier
from ckptflow.format import layout as fmt
from ckptflow.store import open_store
from support.states import tiny_state

RUN = "r"


@pytest.fixture
def tiers(tmp_path):
    """Steps 1 and 2 in the hot store; step 1 archived and its hot copy expired."""
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "archive"))
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, tiny_state(seed=1))
        ck.save(2, tiny_state(seed=2))
    assert lifecycle.archive(hot, arc, RUN, 1).ok
    lifecycle.expire(hot, RUN, 1, keep_records=True)
    return hot, arc


def opener(store):
    opened = []

    def open_archive():
        opened.append(store.url)
        return store

    return open_archive, opened


def test_holds_commit_is_the_commit_record_alone(tiers, tmp_path):
    hot, arc = tiers
    assert holds_commit(hot, RUN, 2) and not holds_commit(hot, RUN, 1)
    assert holds_commit(arc, RUN, 1) and not holds_commit(arc, RUN, 2)
    os.makedirs(tmp_path / "hot" / fmt.step_prefix(RUN, 3) / "ranks")  # a save that died before its commit
    assert not holds_commit(hot, RUN, 3)


def test_the_hot_copy_is_read_while_it_exists_and_the_archive_is_not_opened(tiers):
    hot, arc = tiers
    open_archive, opened = opener(arc)
    assert source_tier(hot, RUN, 2, open_archive) is hot
    assert opened == []


def test_an_expired_hot_copy_is_read_from_the_archive(tiers):
    hot, arc = tiers
    open_archive, opened = opener(arc)
    assert source_tier(hot, RUN, 1, open_archive) is arc
    assert opened == [arc.url]


def test_a_checkpoint_no_tier_holds_is_read_from_the_hot_store(tiers):
    hot, arc = tiers
    open_archive, _ = opener(arc)
    assert source_tier(hot, RUN, 3, open_archive) is hot
