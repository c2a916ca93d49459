"""Saves and restores of state living on a CUDA device: blocking and async saves (the async
one must hold the values of the moment it returned, though training goes on writing the
GPU), every codec, restores onto the device (chunk by chunk, or staged where the target is
laid out differently) and onto the CPU, a real training loop resumed on the GPU (optimizer,
scheduler and CUDA RNG), and host memory bounded while a GPU state is saved or restored.
They need a CUDA device: skipped elsewhere, run on a lent device machine by
``benchmarks/gpu_checks.sh``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from ckptflow import Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20


def _state() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {
        "model": {
            "big": torch.randn(3_000_000, generator=gen, device="cuda"),  # several 1 MiB chunks
            "transposed": torch.randn(512, 256, generator=gen, device="cuda").t(),  # not contiguous
            "half": torch.randn(70_000, generator=gen, device="cuda").to(torch.bfloat16),
            "small": torch.arange(10, device="cuda"),  # packed with other small tensors
            "host": torch.ones(3),
        },
        "step": 3,
    }


def _cpu_copy(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state["model"].items()}


def _zeros_like(state: dict, device: str | None = None) -> dict:
    model = {k: torch.zeros(v.shape, dtype=v.dtype, device=device or v.device) for k, v in state["model"].items()}
    return {"model": model, "step": 0}


def _assert_holds(state: dict, expected: dict) -> None:
    for name, tensor in expected.items():
        assert torch.equal(state["model"][name].cpu(), tensor), name


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
def test_blocking_async_and_incremental_saves_of_a_gpu_state_restore_exactly(tmp_path, codec):
    state = _state()
    with Checkpointer(str(tmp_path), "gpu", codec=codec, chunk_bytes=MiB) as ck:
        ck.save(1, state)
        first = _cpu_copy(state)
        ck.prepare(state)
        state["model"]["big"].mul_(1.5)
        second = _cpu_copy(state)
        handle = ck.save(2, state, blocking=False)
        state["model"]["big"].add_(1.0)  # training goes on: the checkpoint keeps the values it was given
        state["model"]["transposed"].zero_()
        handle.wait()
        third = _cpu_copy(state)
        ck.save(3, state, kind="incremental")
        for step, expected in ((1, first), (2, second), (3, third)):
            on_gpu = _zeros_like(state)
            assert ck.restore(on_gpu, step=step).step == step
            _assert_holds(on_gpu, expected)
            assert on_gpu["model"]["big"].device.type == "cuda"
            on_cpu = _zeros_like(state, "cpu")
            ck.restore(on_cpu, step=step)
            _assert_holds(on_cpu, expected)
            strided = _zeros_like(state)  # a target laid out unlike the stored item: staged, then copied
            strided["model"]["transposed"] = torch.zeros(512, 256, device="cuda").t()
            ck.restore(strided, step=step)
            _assert_holds(strided, expected)


def _training() -> dict:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 8)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, 3, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched}


def _steps(state: dict, n: int) -> list[float]:
    losses = []
    gen = torch.Generator(device="cuda").manual_seed(len(losses))
    for _ in range(n):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        loss = state["model"](x).pow(2).mean()  # dropout draws from the CUDA RNG
        loss.backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["sched"].step()
        losses.append(loss.item())
    return losses


def test_a_training_loop_on_the_gpu_resumes_where_it_stopped(tmp_path):
    torch.manual_seed(0)
    state = _training()
    _steps(state, 5)
    with Checkpointer(str(tmp_path), "train") as ck:
        ck.save(5, state)
        expected = _steps(state, 5)
        torch.manual_seed(123)  # another process's model and RNG
        resumed = _training()
        ck.restore(resumed)
    moments = resumed["optim"].state[resumed["optim"].param_groups[0]["params"][0]]
    assert moments["exp_avg"].device.type == "cuda"
    assert _steps(resumed, 5) == expected


_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from ckptflow import Checkpointer

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    def peak(fn):
        before = rss("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
        fn()
        torch.cuda.synchronize()
        return rss("VmHWM") - before

    root, codec, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(64 << 20, generator=gen, device="cuda") for i in range(mib // 256)}}
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    with Checkpointer(root, "mem", codec=codec) as ck:
        warm = {"model": {"w": torch.randn(64 << 18, device="cuda")}}
        ck.save(1, warm)  # the pools, CUDA's host allocations and this code paged in before measuring
        ck.restore({"model": {"w": torch.empty_like(warm["model"]["w"])}}, step=1)
        save = peak(lambda: ck.save(2, state))
        restore = peak(lambda: ck.restore(target, step=2))
    same = all(torch.equal(state["model"][k], target["model"][k]) for k in state["model"])
    print(json.dumps({"save": save, "restore": restore, "same": same}))
    """
)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_host_memory_stays_bounded_while_a_gpu_state_is_saved_and_restored(tmp_path, codec):
    state_mib = 4096  # the whole state copied to host memory (what a save did before) would be 8x the bound
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path), codec, str(state_mib)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["same"]
    assert peaks["save"] <= 512 * MiB, f"save of a {state_mib} MiB GPU state held +{peaks['save'] / MiB:.0f} MiB"
    assert peaks["restore"] <= 512 * MiB, f"restore held +{peaks['restore'] / MiB:.0f} MiB"
