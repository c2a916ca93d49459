"""An archival stalled between its lease check and its manifest's put, long enough for the
tier's GC to judge its lease dead and sweep the copy's chunks: nothing is left committed
in the tier that names a chunk or rank record that is gone."""

import threading
import time

import torch
from torch import nn

from ckptflow import Checkpointer, gc, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks import leases
from ckptflow.errors import StoreUnavailableError
from ckptflow.format import layout as fmt
from ckptflow.format.manifest import Manifest
from ckptflow.store import open_store
from support.faulty_store import FaultyStore


def test_an_archival_whose_lease_lapsed_during_its_commit_leaves_no_commit_naming_swept_chunks(tmp_path, monkeypatch):
    """The lease used to be checked only before the rank records and the manifest were put:
    a GC of the tier in between swept the copy, and the archive tier held a commit whose
    chunks were gone (3 of them here; the archival reported the rank records it read back
    missing, but left the commit)."""
    monkeypatch.setattr(leases, "HEARTBEAT", 0.05)
    monkeypatch.setattr(leases, "DEAD_AFTER", 0.5)
    hot, cold = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "cold"))
    with Checkpointer(hot, "r") as ck:
        ck.save(1, {"model": nn.Linear(64, 64), "step": torch.tensor(1)})
    tier = FaultyStore(cold)
    pause = tier.pause_before("put_if_absent", lambda key: key == fmt.manifest_key("r", 1))
    outcome: list = []

    def archive() -> None:
        try:
            outcome.append(lifecycle.archive(hot, tier, "r", 1))
        except StoreUnavailableError as e:  # the tier's GC may have swept the copy: retried as an outage
            outcome.append(e)

    archival = threading.Thread(target=archive)
    archival.start()
    try:
        assert pause.reached.wait(30)
        tier.fail_if = lambda op, key: op == "touch" and key.startswith(leases.LEASES)  # renewals stop
        time.sleep(3 * leases.DEAD_AFTER)
        swept = gc(cold, grace=0, now=time.time() + 2, wait=0)
        assert swept.dead_leases and swept.deleted  # the copy looked abandoned: its chunks went
    finally:
        pause.release()
        archival.join(30)
    tier.fail_if = lambda op, key: False
    (result,) = outcome
    missing = [
        key
        for item in catalog.committed(cold)
        if isinstance(item, Manifest)
        for key in [fmt.chunk_key(d) for d in item.chunks] + item.rank_keys()
        if not cold.exists(key)
    ]
    assert missing == [], f"the tier holds a commit naming {len(missing)} swept object(s); archive: {result}"
    assert isinstance(result, StoreUnavailableError) and "nothing was committed: archive again" in str(result)
    assert not cold.exists(fmt.manifest_key("r", 1))
