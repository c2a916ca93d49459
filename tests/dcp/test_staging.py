"""The async save's stager (``ckptflow.dcp.staging``) keeps its host buffers for the
Checkpointer's life: every stage copies into the buffers the first one (``prepare``)
allocated, and the copy is complete when ``stage`` returns."""

from __future__ import annotations

import torch

from ckptflow.dcp import staging
from ckptflow.dcp.staging import CachedStager


def test_every_stage_copies_into_the_buffers_the_first_allocated():
    stager = CachedStager()
    live = {"w": torch.randn(1000), "b": torch.arange(7)}
    first = stager.stage(live)
    addresses = {k: v.data_ptr() for k, v in first.items()}
    for _ in range(3):  # a stager that dropped its cache after one stage failed at the second
        live["w"].add_(1.0)
        staged = stager.stage(live)
        assert {k: v.data_ptr() for k, v in staged.items()} == addresses
        assert all(torch.equal(staged[k], live[k]) for k in live)
    live["w"].zero_()
    assert not torch.equal(staged["w"], live["w"])  # a copy, not the live tensor
    stager.close()


def test_a_stage_needs_no_synchronize_afterwards():
    assert CachedStager().should_synchronize_after_execute is False


def test_a_cpu_state_is_staged_in_plain_memory_without_starting_cuda():
    started = torch.cuda.is_initialized()
    stager = CachedStager()
    staged = stager.stage({"w": torch.randn(100)})
    assert not stager.pinned and not staged["w"].is_pinned()
    assert torch.cuda.is_initialized() == started  # on a GPU machine too: no context for a CPU state


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it is on cuda:1 (no GPU here): what the stager looks at."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)


def test_a_stage_waits_for_the_copies_on_every_device_holding_the_state(monkeypatch):
    """The copies are queued without blocking on each tensor's own device: waiting for the
    current device alone (cuda:0) returned while cuda:1's were still landing in the buffers
    the save writes from, and training went on to change the tensors they copy."""
    waited, staged = [], {}

    class Stager:
        def __init__(self, **kwargs):
            pass

        def stage(self, state, non_blocking):
            staged["non_blocking"] = non_blocking
            return state

        def close(self):
            pass

    monkeypatch.setattr(staging, "StateDictStager", Stager)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    state = {"w": torch.zeros(4).as_subclass(_OnCuda1), "step": torch.tensor(3)}
    staging.CachedStager().stage(state)
    assert staged["non_blocking"] and waited == [torch.device("cuda", 1)]
