"""Chunk writes go to the pool in batches: every write's result lands in its own slot."""

from concurrent.futures import ThreadPoolExecutor, wait

import pytest

from ckptflow.dcp import put_batches
from ckptflow.dcp.put_batches import PutBatches


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as made:
        yield made


def test_each_write_gets_its_own_result_and_a_full_chunk_is_a_batch_of_its_own(pool):
    batches = PutBatches(pool, lambda piece, tag: (len(piece), tag), limit=100, jobs=3)
    sizes = [100, 10, 10, 10, 10, 100, 5]  # one full chunk, then small ones, three at most a batch
    slots = [batches.add(memoryview(bytes(n)), i) for i, n in enumerate(sizes)]
    batches.flush()
    wait(batches.submitted)
    assert [put_batches.result(slot) for slot in slots] == [(n, i) for i, n in enumerate(sizes)]
    calls = [len(future.result()) for future in batches.submitted]
    assert calls == [1, 3, 2, 1]  # [100], [10, 10, 10], [10, 100 (reaches the limit)], [5]


def test_a_failed_write_fails_its_batch_and_no_other(pool):
    def put(piece, tag):
        if tag == 4:
            raise OSError("disk gone")
        return tag

    batches = PutBatches(pool, put, limit=1 << 20, jobs=2)
    slots = [batches.add(memoryview(b"x"), i) for i in range(6)]
    batches.flush()
    wait(batches.submitted)
    assert [put_batches.result(slot) for slot in slots[:4]] == [0, 1, 2, 3]
    for slot in slots[4:]:  # 4 and 5 share a batch
        with pytest.raises(OSError, match="disk gone"):
            put_batches.result(slot)
