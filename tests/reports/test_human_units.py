"""Money reads as money (a currency, significant digits, never e-notation), a negative saving
is said as a cost, and the CLI's cost table uses both."""

from __future__ import annotations

from ckptflow.cli.costs import render
from ckptflow.reports.costs import SAVINGS, CostReport, TierCost
from ckptflow.reports.units import human_saving, human_usd


def test_money_has_a_currency_and_significant_digits_never_e_notation():
    assert human_usd(0.00016679439134895802) == "$0.000167"
    assert human_usd(2.25e-05, per="/month") == "$0.0000225/month"
    assert human_usd(-3.49e-05) == "-$0.0000349"
    assert human_usd(0) == "$0.00" and human_usd(0.5) == "$0.50" and human_usd(0.0123) == "$0.0123"
    assert human_usd(1234.567) == "$1,234.57" and human_usd(None) == "-"
    for x in (1e-9, 3.3e-7, 0.00042, 0.07, 12.0):
        assert "e" not in human_usd(x), human_usd(x)


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
