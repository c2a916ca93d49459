"""Progress of long operations in the Dagster run's log (``assets.progress``), and the
figures they report as metadata: the throttling on a fake clock, then real runs of the
per-checkpoint assets, of the scrub job (and its repairs) and of a promotion, whose lines
must add up to what each operation reported."""

import re
import threading

import pytest
from dagster import DagsterEventType, materialize

import assets.progress
from assets import PARTITIONED, archived, checkpoint, checkpoint_key
from assets.progress import ProgressLog
from ckptflow import lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.interop.export import export_safetensors
from ckptflow.interop.registry import Registry
from ckptflow.reports.units import human_bytes
from ckptflow.store import open_store
from support.corrupt import corrupt_chunk
from support.dagster import RUN, scrub_all

MB = 1_000_000
KEY = checkpoint_key(RUN, 20)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def meter(total=None):
    lines: list[str] = []
    clock = Clock()
    return ProgressLog(lines.append, "copying", total=total, every_s=10.0, clock=clock), lines, clock


def feed(progress, clock, at: float, n: int) -> None:
    clock.now = 100.0 + at
    progress(n)


def test_a_line_per_interval_or_per_tenth_of_the_total_not_per_call():
    progress, lines, clock = meter(total=100 * MB)
    feed(progress, clock, 0.5, 5 * MB)  # under a tenth, under the interval
    feed(progress, clock, 0.8, 6 * MB)  # a tenth, but within a tenth of the interval of the start
    assert lines == []
    feed(progress, clock, 2.0, 1 * MB)  # still the first tenth, now 2 s after the last line: due
    feed(progress, clock, 2.5, 1 * MB)  # no new tenth, 0.5 s later
    feed(progress, clock, 12.4, 1 * MB)  # no new tenth, but the interval passed
    feed(progress, clock, 12.6, 26 * MB)  # the fourth tenth, 0.2 s later: too soon
    feed(progress, clock, 14.0, 55 * MB)  # the ninth tenth, 1.6 s later: due
    feed(progress, clock, 15.5, 5 * MB)  # all of it: no tenth's line, the final line says so
    assert lines == [
        f"copying: {human_bytes(12 * MB)} of {human_bytes(100 * MB)} (12%), 6.0 MB/s",
        f"copying: {human_bytes(14 * MB)} of {human_bytes(100 * MB)} (14%), 1.1 MB/s",
        f"copying: {human_bytes(95 * MB)} of {human_bytes(100 * MB)} (95%), 6.8 MB/s",
    ]
    clock.now = 120.0
    progress.finish()
    assert lines[-1] == f"copying: finished after {human_bytes(100 * MB)} ({100 * MB} bytes) in 20.0 s, 5.0 MB/s"
    assert progress.seconds == 20.0 and len(lines) == 4


def test_without_a_total_a_line_per_interval_and_a_stop_says_how_far_it_got():
    progress, lines, clock = meter()
    for second in range(1, 26):
        feed(progress, clock, second, MB)
    assert lines == [f"copying: {human_bytes(10 * MB)}, 1.0 MB/s", f"copying: {human_bytes(20 * MB)}, 1.0 MB/s"]
    progress.finish(ok=False)
    assert lines[-1] == f"copying: stopped after {human_bytes(25 * MB)} ({25 * MB} bytes) in 25.0 s, 1.0 MB/s"


def test_an_instant_operation_logs_no_rate_and_counts_from_many_threads():
    progress, lines, _ = meter(total=8000)
    workers = [threading.Thread(target=lambda: [progress(1) for _ in range(1000)]) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    progress.finish()
    assert progress.done == 8000 and lines == ["copying: finished after 7.8 KiB (8000 bytes) in 0.0 s"]


def final_bytes(logs: list[str], what: str) -> int:
    [line] = [line for line in logs if line.startswith(f"{what}: finished after ")]
    return int(re.search(r"\((\d+) bytes\)", line).group(1))


def steps_logged(logs: list[str], what: str) -> list[str]:
    return [line for line in logs if line.startswith(f"{what}: ") and " after " not in line]


@pytest.fixture
def every_call_logged(monkeypatch):
    """No throttling: each call of the library's callback writes its line."""
    monkeypatch.setattr(assets.progress, "EVERY_S", 0.0)


def rate_matches(md, name: str, n: int) -> bool:
    seconds, mbs = md[f"{name}_seconds"].value, md[f"{name}_mb_per_s"].value
    return seconds > 0 and abs(mbs - n / MB / seconds) <= 0.01 * mbs


def test_validation_compression_and_archival_log_progress_that_adds_up_to_what_they_report(
    store_with_checkpoints, paths, resources, instance, every_call_logged
):
    instance.add_dynamic_partitions("checkpoints", [KEY])
    result = materialize(PARTITIONED, partition_key=KEY, instance=instance, resources=resources)
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    hot = open_store(paths["store"])

    [check] = result.get_asset_check_evaluations()
    checked = check.metadata[f"{RUN}/bytes"].value
    assert checked > 0 and final_bytes(logs, f"validating {KEY}") == checked
    validating = steps_logged(logs, f"validating {KEY}")
    assert len(validating) == check.metadata[f"{RUN}/chunks"].value  # one line per chunk, none throttled
    assert all(f" of {human_bytes(checked)} (" in line for line in validating)  # the total known up front
    assert validating[-1].startswith(f"validating {KEY}: {human_bytes(checked)} of {human_bytes(checked)} (100%)")
    assert rate_matches(check.metadata, "validation", checked)
    [validated] = result.asset_materializations_for_node("checkpoint")
    assert rate_matches(validated.metadata, "validation", checked)

    [comp] = result.asset_materializations_for_node("compressed")
    content = comp.metadata["content_bytes"].value
    assert content == lifecycle.content_bytes(hot, RUN, 20) == checked
    assert final_bytes(logs, f"compressing {KEY}") == content
    assert rate_matches(comp.metadata, "compression", content)

    [arc] = result.asset_materializations_for_node("archived")
    copied = arc.metadata["copied_bytes"].value
    archiving = f"archiving {KEY} to {open_store(paths['archive']).url}"
    assert copied > 0 and final_bytes(logs, archiving) == copied
    assert len(steps_logged(logs, archiving)) == arc.metadata["chunks_copied"].value
    assert rate_matches(arc.metadata, "archival", copied)


def test_scrub_logs_each_tiers_progress_and_reports_its_bytes_time_and_rate(store_with_checkpoints, defs, instance):
    result = scrub_all(defs, instance)
    [output] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    md = output.event_specific_data.metadata
    store = open_store(store_with_checkpoints)
    every = sum(lifecycle.content_bytes(store, RUN, step) for step in (10, 20, 30, 40))
    assert md["hot_checked"].value == 4 and md["hot_scrubbed_bytes"].value == every
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert final_bytes(logs, f"scrubbing {store.url}") == every
    assert rate_matches(md, "hot_scrub", every)
    assert md["archive_scrubbed_bytes"].value == 0 and md["archive_checked"].value == 0  # nothing archived


def percents(lines: list[str]) -> list[int]:
    return [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]


def test_the_reread_of_an_archive_copy_is_a_phase_of_its_own_from_0_to_100_percent(
    store_with_checkpoints, paths, resources, instance, every_call_logged
):
    instance.add_dynamic_partitions("checkpoints", [KEY])
    result = materialize(
        PARTITIONED, partition_key=KEY, instance=instance, resources=resources, selection=[checkpoint, archived]
    )
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    arc = open_store(paths["archive"])
    [md] = [m.metadata for m in result.asset_materializations_for_node("archived")]
    everything = sum(catalog.read_manifest(arc, RUN, 20).chunks.values())  # every chunk re-read, present or copied
    verifying = f"verifying the copy of {KEY} in {arc.url}"
    lines = steps_logged(logs, verifying)
    assert len(lines) == md["chunks_verified"].value == len(catalog.read_manifest(arc, RUN, 20).chunks)
    assert all(f" of {human_bytes(everything)} (" in line for line in lines)
    assert percents(lines) == sorted(percents(lines)) and percents(lines)[-1] == 100  # never past 100, never restarts
    assert final_bytes(logs, verifying) == md["reread_bytes"].value == everything
    assert rate_matches(md, "reread", everything)
    archiving = f"archiving {KEY} to {arc.url}"  # the copy's own lines count only what was copied
    assert final_bytes(logs, archiving) == md["copied_bytes"].value


def test_scrub_logs_each_tiers_repair_and_reports_the_bytes_repaired(store_with_checkpoints, defs, paths, instance):
    hot, arc = open_store(store_with_checkpoints), open_store(paths["archive"])
    assert lifecycle.archive(hot, arc, RUN, 20).ok
    rotten = corrupt_chunk(store_with_checkpoints, RUN, 20)
    result = scrub_all(defs, instance)
    [output] = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    md = output.event_specific_data.metadata
    repaired = catalog.read_manifest(hot, RUN, 20).chunks[rotten]  # the chunk's content, as its checkpoint lists it
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert md["hot_chunks_repaired"].value == 1 and md["hot_repaired_bytes"].value == repaired
    assert final_bytes(logs, f"repairing {hot.url} from {arc.url}") == repaired
    assert rate_matches(md, "hot_repair", repaired)
    assert md["archive_repaired_bytes"].value == 0 and final_bytes(logs, f"repairing {arc.url} from {hot.url}") == 0


def test_a_promotion_logs_its_exports_progress_and_reports_the_bytes_read_time_rate_and_model_size(
    store_with_checkpoints, defs, instance, tmp_path, every_call_logged
):
    run_config = {"ops": {"deployed_model": {"config": {"action": "promote", "partition_key": KEY}}}}
    result = defs.resolve_job_def("promotion").execute_in_process(instance=instance, run_config=run_config)
    [md] = [m.metadata for m in result.asset_materializations_for_node("deployed_model")]
    counted: list[int] = []  # the same export, by the library, counted
    export_safetensors(store_with_checkpoints, RUN, tmp_path / "direct", step=20, progress=counted.append)
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    exporting = f"exporting {KEY} as tinylm"
    assert md["exported_bytes"].value == sum(counted) == final_bytes(logs, exporting) > 0
    assert len(steps_logged(logs, exporting)) == len(counted)  # one line per chunk read, none throttled
    assert rate_matches(md, "promotion", sum(counted))
    files = Registry(open_store(store_with_checkpoints)).get("tinylm", md["version"].value).files
    assert md["model_bytes"].value == sum(f["size"] for f in files.values()) > 0
