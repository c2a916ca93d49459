"""The operator's view in a real browser: headless Chromium (Debian's ``chromium``, driven by
playwright; no browser download) against ``dagster dev`` on 127.0.0.1 after the demo.

Asserts what an operator looks at first: the code location loaded; the checkpoint
asset's Partitions tab lists the demo's partitions with the corrupt ones Failed;
evaluation's metrics plot; the deployed model names its source partition; a backfill of
``evaluation`` over a partition range, launched from the UI, completes. Screenshots go
to ``CKPTFLOW_UI_SCREENSHOTS`` or ``.ci/artifacts/ui-screenshots/`` (CI keeps them).

Slow (the demo, then the UI): ``make test-e2e`` and ``.ci/run`` run it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import pytest
from dagster import AssetKey, DagsterInstance, DagsterRunStatus

from assets.partitions import checkpoint_key
from ckptflow.interop.registry import Registry
from ckptflow.store import open_store
from pipelines.demo import daemon
from sensors.failures import partition_of
from support.canvas_labels import RECORD_LABELS, corners, overlap
from support.postgres import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CHROMIUM = os.environ.get("CKPTFLOW_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SHOTS = os.environ.get("CKPTFLOW_UI_SCREENSHOTS") or os.path.join(daemon.REPO, ".ci", "artifacts", "ui-screenshots")
TIMEOUT_MS = 90_000
DEMO_RUN, OTHER_RUN = "tinylm-demo", daemon.DEMO_RUN
CORRUPT = [checkpoint_key(DEMO_RUN, 60), checkpoint_key(OTHER_RUN, 60)]
BACKFILL = [checkpoint_key(DEMO_RUN, s) for s in (10, 20, 30)]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium; .ci/run does)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """The demo (training, crash, recovery, in-process lifecycle, the daemon's part), then
    ``dagster dev`` on its instance and store; the webserver's base URL and the paths."""
    root = tmp_path_factory.mktemp("ui")
    store = str(root / "store")
    env = daemon.lifecycle_env(str(root / "store-dagster_home"), store, store + "-archive")
    demo = subprocess.run(
        [sys.executable, "-m", "pipelines.demo", "--store", store, "--steps", "60", "--crash-at", "35"],
        cwd=daemon.REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    port = free_port()
    log = str(root / "dagster-dev.log")
    command = [daemon.dagster_bin("dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    process = daemon.start(command, env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        assert daemon.wait_until(lambda: _answers(base), timeout_s=180), open(log).read()[-3000:]
        yield {"base": base, "home": env["DAGSTER_HOME"], "log": log, "store": store}
    finally:
        daemon.stop(process)


def _answers(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/server_info", timeout=5).status == 200
    except OSError:
        return False


@pytest.fixture
def page(browser, ui, request):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    os.makedirs(SHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SHOTS, f"{request.node.name}.png"), full_page=True)
    context.close()


def shot(page, name: str) -> None:
    os.makedirs(SHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)


def test_code_location_loaded(page, ui):
    page.goto(ui["base"] + "/locations")
    page.get_by_text("1 code location").wait_for()
    page.get_by_text("pipelines.definitions").first.wait_for()
    page.get_by_text("Loaded", exact=True).wait_for()


def test_checkpoint_partitions_show_the_corrupt_ones_failed(page, ui):
    page.goto(ui["base"] + "/assets/checkpoint?view=partitions")
    page.get_by_text("Failed (2)").wait_for()
    page.get_by_text("Materialized (7)").wait_for()  # 5 of the TinyLM's 6, 2 of the regressor's 3
    for key in [checkpoint_key(DEMO_RUN, s) for s in range(10, 70, 10)] + [checkpoint_key(OTHER_RUN, 20)]:
        page.get_by_text(key, exact=True).first.wait_for()
    shot(page, "checkpoint_partitions_all")
    page.get_by_text("Materialized (7)").click()  # hide the good ones: what is left is what failed
    page.get_by_text(CORRUPT[0], exact=True).first.wait_for()
    page.get_by_text(CORRUPT[1], exact=True).first.wait_for()
    assert page.get_by_text(checkpoint_key(DEMO_RUN, 50), exact=True).count() == 0
    page.get_by_text(CORRUPT[0], exact=True).first.click()
    page.get_by_text("failed, and did not materialize this asset").wait_for()
    shot(page, "checkpoint_partitions_failed")
    page.goto(ui["base"] + "/assets/checkpoint?view=checks")  # the integrity check, per partition
    page.get_by_text("integrity", exact=True).first.wait_for()
    page.get_by_text("rpo_freshness", exact=True).first.wait_for()


def test_evaluation_metrics_plot_across_partitions_one_line_per_run(page, ui):
    page.add_init_script(RECORD_LABELS)
    page.goto(ui["base"] + "/assets/evaluation")  # the overview's Metadata section: Table / Plots
    page.get_by_text("val_loss").first.wait_for()
    page.get_by_text("Plots", exact=True).click()
    for metric in ("val_loss", "train_loss", "val_perplexity"):  # keyed by run: two models' losses are no one line
        page.get_by_text(f"{DEMO_RUN}/{metric}", exact=True).first.wait_for()
    page.get_by_text(f"{OTHER_RUN}/val_loss", exact=True).first.wait_for()
    page.locator("canvas").nth(3).wait_for()  # one chart per run and metric, plotted by partition
    shot(page, "evaluation_plots_per_run")
    # the partition keys on each chart's axis, as last drawn, never overlap one another
    drawn: dict[tuple[str, str], dict] = {}
    for label in page.evaluate("window.__labels"):
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*@\d+", label["text"]):
            drawn[(label["canvas"], label["text"])] = label
    by_chart: dict[str, list[dict]] = {}
    for (chart, _), label in drawn.items():
        by_chart.setdefault(chart, []).append(label)
    assert len(by_chart) >= 4 and all(len(labels) >= 2 for labels in by_chart.values()), by_chart.keys()
    for labels in by_chart.values():
        for i, one in enumerate(labels):
            for other in labels[i + 1 :]:
                assert not overlap(corners(one), corners(other)), (one["text"], other["text"])


def test_deployed_model_names_its_source_partition(page, ui):
    page.goto(ui["base"] + "/assets/deployed_model?view=events")
    page.get_by_text("source_partition").first.wait_for()
    stable = Registry(open_store(ui["store"])).resolve("tinylm", "stable")
    page.get_by_text(stable.partition_key, exact=True).first.wait_for()


def test_backfill_of_evaluation_launched_from_the_ui_completes(page, ui):
    with DagsterInstance.from_config(ui["home"]) as instance:
        before = {b.backfill_id for b in instance.get_backfills()}
    page.goto(ui["base"] + "/assets/evaluation?view=partitions")
    page.get_by_role("button", name="Materialize…").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Partition selection").wait_for()
    dialog.get_by_text("Select a partition or create one").click()
    for key in BACKFILL:  # a range: three consecutive checkpoints of the demo run
        page.get_by_role("menuitem").filter(has_text=key).first.click()
    page.keyboard.press("Escape")
    dialog.get_by_text("3 partitions").first.wait_for()
    shot(page, "backfill_dialog")
    dialog.get_by_role("button", name="Launch backfill").click()

    with DagsterInstance.from_config(ui["home"]) as instance:

        def finished():
            new = [b for b in instance.get_backfills() if b.backfill_id not in before]
            return bool(new) and new[0].status.value != "REQUESTED"

        assert daemon.wait_until(finished, timeout_s=300, poll_s=2), open(ui["log"]).read()[-3000:]
        [backfill] = [b for b in instance.get_backfills() if b.backfill_id not in before]
        runs = instance.get_runs()
        runs = [r for r in runs if r.tags.get("dagster/backfill") == backfill.backfill_id]
    assert backfill.status.value == "COMPLETED_SUCCESS", backfill.status
    assert sorted(partition_of(r) for r in runs) == BACKFILL  # one run per checkpoint (BackfillPolicy)
    assert {r.status for r in runs} == {DagsterRunStatus.SUCCESS}
    page.goto(ui["base"] + f"/runs/b/{backfill.backfill_id}")
    page.get_by_text("Completed").first.wait_for()


# --- the operator's view (issue 24) ---------------------------------------------------------


def _latest_metadata(ui, asset: str) -> dict:
    with DagsterInstance.from_config(ui["home"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey(asset))
        assert event is not None and event.asset_materialization is not None, asset
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def test_recoverability_answers_is_training_recoverable_now(page, ui):
    """One place: per run the newest recovery-ready checkpoint, RPO with its target, the last
    recovery and its RTO, "N of M need attention"; bytes and $/month per tier."""
    page.goto(ui["base"] + "/assets/recoverability")
    page.get_by_text(
        "yes: every run (2) has a recovery-ready checkpoint; 2 of 9 checkpoints need attention", exact=True
    ).wait_for()
    for cell in ("1 of 6 need attention", "1 of 3 need attention", "hot+archive"):
        page.get_by_text(cell, exact=True).first.wait_for()
    rpo = re.compile(r"^(\d+\.\d (s|min|h)|\d[\d.]* (ms|µs)) \(target 60\.0 min: met\)$")  # RPO, target
    page.get_by_text(rpo).first.wait_for()
    page.get_by_text(re.compile(r"^chunk hash: chunk [0-9a-f]{12}… does not match its address")).first.wait_for()
    shot(page, "recoverability")


def test_every_report_shows_one_price_per_tier(page, ui):
    """The inventory, the cost report and the operator's view price a tier alike."""
    shown = {name: _latest_metadata(ui, name) for name in ("checkpoint_inventory", "storage_cost", "recoverability")}
    for tier in ("hot", "archive"):
        assert len({md[f"{tier}_monthly_usd"] for md in shown.values()}) == 1, (tier, shown)
    archive_cost = shown["storage_cost"]["archive_cost"]
    assert shown["storage_cost"]["archive_monthly_usd"] > 0 and archive_cost.startswith("$")
    for name in shown:
        page.goto(ui["base"] + f"/assets/{name}")
        page.get_by_text("archive_monthly_usd", exact=True).first.wait_for()
        page.get_by_text(archive_cost, exact=True).first.wait_for()
    shot(page, "inventory_prices")


def test_a_corrupt_partition_says_why_on_its_own_page(page, ui):
    """The partition's events say which chunk and which check, in plain fields; the
    integrity check's latest result says it in its description; the asset's description
    says a Failed partition is one checkpoint needing attention."""
    page.goto(ui["base"] + f"/assets/checkpoint?view=events&partition={CORRUPT[0]}")
    page.get_by_text(re.compile(r"^blocked by the integrity check: chunk hash: chunk [0-9a-f]{12}…")).first.wait_for()
    page.get_by_text("integrity: chunk hash", exact=True).first.wait_for()
    page.get_by_text(re.compile(r"^[0-9a-f]{12}…$")).first.wait_for()  # the chunk
    assert page.get_by_text("[Show Markdown]").count() == 0
    shot(page, "corrupt_partition_events")
    page.goto(ui["base"] + "/assets/checkpoint?view=checks")
    page.get_by_text(re.compile(r"step 60 needs attention: chunk hash: chunk [0-9a-f]{12}…")).first.wait_for()
    shot(page, "integrity_check")
    page.goto(ui["base"] + "/assets/checkpoint")
    page.get_by_text("checkpoint that needs attention, not a broken pipeline").first.wait_for()


def test_integrity_plots_one_line_per_run_and_the_demo_evaluation_has_train_loss(page, ui):
    page.goto(ui["base"] + "/assets/checkpoint?view=checks")
    page.get_by_text("integrity", exact=True).first.wait_for()
    for run in (DEMO_RUN, OTHER_RUN):
        page.get_by_text(f"{run}/chunks", exact=True).first.wait_for()
    shot(page, "integrity_plots")
    page.goto(ui["base"] + f"/assets/evaluation?view=partitions&partition={checkpoint_key(DEMO_RUN, 50)}")
    page.get_by_text(f"{DEMO_RUN}/val_perplexity", exact=True).first.wait_for()  # the demo's evaluator scored it
    page.get_by_text(f"{DEMO_RUN}/train_loss", exact=True).first.wait_for()  # the trainer's loss stands beside it


def test_runs_list_shows_which_checkpoint_each_run_is_about(page, ui):
    page.goto(ui["base"] + "/runs")
    tag = page.get_by_text(re.compile(r"^checkpoint: (tinylm|regressor)-demo@\d+$")).first
    tag.wait_for()
    assert tag.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), "the checkpoint tag is cut in the Runs list"
    shot(page, "runs_list")
