"""Money reads as money (a currency, significant digits, never e-notation), a negative saving
is said as a cost, and the CLI's cost table uses both; a duration under a second reads in
milliseconds or microseconds, never "0.0 s"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptflow import Checkpointer
from ckptflow.cli.costs import render
from ckptflow.format import layout as fmt
from ckptflow.reports.costs import SAVINGS, CostReport, TierCost, describe, item
from ckptflow.reports.units import human_duration, human_period, human_saving, human_steps, human_usd
from support.cli import run_cli


def test_money_has_a_currency_and_significant_digits_never_e_notation():
    assert human_usd(0.00016679439134895802) == "$0.000167"
    assert human_usd(2.25e-05, per="/month") == "$0.0000225/month"
    assert human_usd(-3.49e-05) == "-$0.0000349"
    assert human_usd(0) == "$0.00" and human_usd(0.5) == "$0.50" and human_usd(0.0123) == "$0.0123"
    assert human_usd(1234.567) == "$1,234.57" and human_usd(None) == "-"
    for x in (1e-9, 3.3e-7, 0.00042, 0.07, 12.0):
        assert "e" not in human_usd(x), human_usd(x)


def test_a_duration_under_a_second_is_said_in_milliseconds_or_microseconds():
    """A 12 ms save printed "0.0 s" (in ``ckptflow advise``'s inputs, the progress logs)."""
    assert human_duration(0.012) == "12 ms" and human_duration(0.0123) == "12.3 ms"
    assert human_duration(0.48) == "480 ms" and human_duration(0.9994) == "999 ms"
    assert human_duration(0.9996) == "1.0 s" and human_duration(1.25) == "1.2 s"  # never "1e+03 ms"
    assert human_duration(0.000042) == "42 µs" and human_duration(0.0009996) == "1 ms"
    assert human_duration(1e-06) == "1 µs" and human_duration(-0.012) == "-12 ms"
    assert human_duration(0) == "0.0 s" and human_duration(None) == "-"
    assert human_duration(90) == "90.0 s" and human_duration(600) == "10.0 min" and human_duration(9000) == "2.5 h"


def test_a_duration_past_a_year_and_a_step_count_past_a_billion_are_said_in_a_few_digits():
    """``ckptflow advise --mtbf 1e300s`` printed an MTBF, an interval and a step count of
    150 to 300 digits each, one line wider than any terminal."""
    year = 365.25 * 86400
    assert (
        human_duration(1e300) == "3.17e+292 years"
        and human_duration(2 * year) == "2 years"
        and human_duration(year) == "1 year"
    )
    assert human_duration(9000) == "2.5 h" and human_duration(300 * 86400) == "7200.0 h"  # up to a year as before
    assert (
        human_steps(9.93e148) == "9.93e+148" and human_steps(181) == "181" and human_steps(999_999_999) == "999999999"
    )


def test_a_negative_saving_is_said_as_a_cost():
    assert human_saving(-3.49e-05) == "costs $0.0000349/month more"
    assert human_saving(0.0021) == "saves $0.0021/month"


def test_cli_cost_table_prints_money_and_explains_a_negative_saving():
    report = CostReport(
        tiers=[TierCost(tier="hot", storage_class="STANDARD", price=0.023, checkpoints=3, stored_bytes=7 << 20,
                        monthly_usd=0.00016679439134895802)],
        baseline_bytes=9 << 20, baseline_usd=0.0002,
        savings_bytes={k: 0 for k in SAVINGS} | {"delta": 1 << 20},
        savings_usd={k: 0.0 for k in SAVINGS} | {"delta": 2.3e-05, "tiering": -3.49e-05},
        prices_date="2026-01-01",
    )  # fmt: skip
    out = render(report)
    assert "$0.000167" in out and "e-0" not in out and "-$" not in out
    assert "saved by delta" in out and "tiering costs more" in out and "$0.0000349" in out
    assert "held in both tiers" in out


def test_costs_more_is_said_only_of_tiering_other_negative_items_are_plain_sizes(tmp_path, capsys):
    """A hot store alone with one unreferenced chunk file: ``ckptflow stats`` printed
    "garbage costs more  -112 B" and the note "a checkpoint still held in both tiers, paid
    twice", with no archive at all. Garbage is bytes held, said as such, its size a size."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "z", codec="zstd") as ckpt:
        ckpt.save(1, {"model": {"w": torch.zeros(4096)}})
        ckpt.save(2, {"model": {"w": torch.ones(4096)}})
    (Path(root) / fmt.manifest_key("z", 1)).unlink()  # step 1's chunk is garbage now
    code, out, err = run_cli(capsys, "stats", root, "--json")
    doc = json.loads(out)
    garbage = doc["store"]["unreferenced_bytes"]
    assert code == 0 and garbage > 0 and doc["costs"]["savings_usd"]["garbage"] < 0
    assert doc["costs"]["savings_usd"]["tiering"] == 0
    code, out, err = run_cli(capsys, "stats", root)
    assert code == 0, err
    assert "costs more" not in out and "both tiers" not in out, out
    (row,) = [line for line in out.splitlines() if "garbage" in line]
    assert row.lstrip().startswith("+ garbage (unreferenced chunk files, until gc)")
    assert f" {garbage} B " in row and "-" not in row.split(")", 1)[1], row  # a plain size, no minus sign
    assert describe("garbage", -2.4e-09, -112).startswith("adds $0.0000000024/month: garbage")
    assert describe("tiering", -3.49e-05, 0) == "costs $0.0000349/month more"


def test_the_both_tiers_note_follows_tiering_alone():
    report = CostReport(
        tiers=[TierCost(tier="hot", storage_class="STANDARD", price=0.023, checkpoints=1, stored_bytes=1 << 20,
                        monthly_usd=2.2e-05)],
        baseline_bytes=2 << 20, baseline_usd=4.5e-05,
        savings_bytes={k: 0 for k in SAVINGS} | {"delta": -(3 << 10), "garbage": -(5 << 10)},
        savings_usd={k: 0.0 for k in SAVINGS} | {"delta": -6.7e-08, "garbage": -1.1e-07, "retention": 2.3e-05},
        prices_date="2026-01-01",
    )  # fmt: skip
    out = render(report)
    assert "costs more" not in out and "both tiers" not in out, out
    assert "+ delta bases" in out and "3.0 KiB" in out and "5.0 KiB" in out and "-3.0" not in out
    tiered = render(CostReport(**{**report.__dict__, "savings_usd": report.savings_usd | {"tiering": -1e-06}}))
    assert "+ tiering costs more" in tiered and "held in both tiers" in tiered


def test_a_missing_chunk_is_said_as_lost_never_as_saved_by_garbage(tmp_path, capsys):
    """A chunk referenced but absent was netted into "garbage": a store missing one chunk
    (and holding no garbage) printed "- saved by garbage  16.0 KiB"."""
    root = str(tmp_path / "store")
    with Checkpointer(root, "z") as ckpt:
        ckpt.save(1, {"model": {"w": torch.zeros(4096)}})
    [chunk] = [p for p in (Path(root) / "chunks").rglob("*") if p.is_file()]
    chunk.unlink()
    code, out, err = run_cli(capsys, "stats", root)
    assert "saved by garbage" not in out and "garbage" not in out, out
    (row,) = [line for line in out.splitlines() if "missing chunks" in line]
    assert row.lstrip().startswith("- missing chunks (referenced, absent: lost, not saved)") and "16.0 KiB" in row
    code, out, err = run_cli(capsys, "stats", root, "--json")
    doc = json.loads(out)
    assert doc["costs"]["savings_bytes"]["missing"] == 4096 * 4 and doc["costs"]["savings_bytes"]["garbage"] == 0
    said = describe("missing", 3.6e-07, 4096 * 4)
    assert said == "$0.00000036/month not paid for: missing chunks (referenced, absent: lost, not saved)"


@pytest.mark.parametrize("name", SAVINGS)
@pytest.mark.parametrize(("usd", "nbytes"), [(2.3e-05, 1 << 20), (0.0, 0), (0.0, -(5 << 10)), (-1.1e-07, -(5 << 10))])
def test_the_metadata_words_for_an_item_say_what_its_table_row_says(name, usd, nbytes):
    """``describe`` (the ``saving/<k>`` metadata) had a rule of its own beside ``item`` (the
    tables'): no garbage at all read "saves $0.00/month" next to the table's "+ garbage
    (unreferenced chunk files, until gc)", and delta bases at a price of zero "saves $0.00/month"
    next to "+ delta bases". The words now come from ``item``: what adds never "saves"."""
    label, way = item(name, usd, nbytes)
    said = describe(name, usd, nbytes)
    if way == "adds":
        assert said.startswith(("adds ", "costs ")) and "saves" not in said, said
        assert said.endswith(label) or label == f"{name} costs more", said
    else:
        assert said.startswith("saves ") or said.endswith(f"not paid for: {label}"), said


def test_preset_mtbfs_read_in_the_unit_they_were_chosen_in(tmp_path, capsys):
    """The presets were formatted by hand twice (``v / 3600:g`` h): the week-long 'reliable'
    preset read "168 h". One formatter says each as chosen, in the help and in the note."""
    assert [human_period(s) for s in (4 * 3600, 24 * 3600, 7 * 86400, 2 * 86400)] == ["4 h", "24 h", "7 days", "2 days"]
    assert human_period(5400) == human_duration(5400) == "90.0 min"  # not round: as any duration
    assert human_period(1e300) == human_duration(1e300)  # past a year: years, never 10^295 days
    code, out, _ = run_cli(capsys, "advise", "--help")
    helptext = " ".join(out.split())
    assert code == 0
    assert "a preset MTBF: preemptible 4 h; reliable 7 days; unstable-network 24 h" in helptext

    root = str(tmp_path / "store")
    with Checkpointer(root, "r") as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((8,), float(step))})
    code, out, err = run_cli(capsys, "advise", root, "--run", "r")
    assert code == 0, err
    assert "using the 'unstable-network' preset (MTBF 24 h); give an MTBF or a scenario to override" in out
