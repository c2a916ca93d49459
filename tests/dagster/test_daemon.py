"""The real thing: ``dagster-daemon run`` (and ``dagster-webserver``) as separate processes
on a fresh instance, checkpoints committed by a separate training process with its own
model (``pipelines.demo.regressor``, trainer-reported metrics, the newest corrupted),
on SQLite with the default sensor intervals and on a real PostgreSQL server with the
production instance config.

Slow (a minute or two each): ``make test-e2e`` and ``.ci/run`` run them.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest
from dagster import AssetKey, AssetPartitionStatus, DagsterInstance, DagsterRunStatus

from assets.partitions import checkpoint_key, checkpoints_partitions
from pipelines.demo import daemon
from sensors.failures import FAILURE_TAG
from support.postgres import free_port, postgres_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INSTANCE = os.path.join(daemon.REPO, "pipelines", "instance")
RUN = "regressor-demo"
STEPS = (20, 40, 60)  # the regressor commits every 20 steps; 60 is corrupted after its commit


@pytest.fixture
def lifecycle(tmp_path):
    """A fresh DAGSTER_HOME, store and archive; the environment of this checkout's code location."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    paths = {"home": str(home), "store": str(tmp_path / "store"), "archive": str(tmp_path / "archive")}
    env = daemon.lifecycle_env(paths["home"], paths["store"], paths["archive"])
    for name in ("CKPTFLOW_SENSOR_INTERVAL_S", "CKPTFLOW_EVALUATORS", "CKPTFLOW_DEPLOYMENT"):
        env.pop(name, None)  # what a user gets by default
    return paths, env


def report(capsys, title: str, outcomes: list[daemon.Outcome]) -> None:
    with capsys.disabled():
        print(f"\n{title}")
        for o in outcomes:
            after = {k: f"{v:5.1f} s" for k, v in o.after_s.items()}
            print(
                f"  {o.key}: commit -> validated {after.get('checkpoint', '    -  ')}, "
                f"-> archived {after.get('archived', '    -  ')}, -> evaluated {after.get('evaluation', '    -  ')}"
                + ("  (blocked by its integrity check)" if o.blocked else "")
            )


def runs_by_partition(instance: DagsterInstance) -> dict[tuple[str, str], list]:
    out: dict[tuple[str, str], list] = {}
    for run in instance.get_runs():
        what = ",".join(sorted(k.to_user_string() for k in run.asset_selection or [])) or run.job_name
        out.setdefault((what, run.tags.get("dagster/partition", "")), []).append(run)
    return out


def test_daemon_on_sqlite_carries_another_models_checkpoints_through_with_default_intervals(lifecycle, capsys):
    paths, env = lifecycle
    shutil.copy(os.path.join(INSTANCE, "local.yaml"), os.path.join(paths["home"], "dagster.yaml"))
    daemon.prepare_instance(paths["home"])
    log = os.path.join(paths["home"], "daemon.log")
    process = daemon.start([daemon.dagster_bin("dagster-daemon"), "run", "-w", "workspace.yaml"], env, log)
    keys = [checkpoint_key(RUN, s) for s in STEPS]
    try:
        with DagsterInstance.from_config(paths["home"]) as instance:
            assert daemon.wait_for_daemon(instance), open(log).read()[-3000:]
            out = daemon.train_other_model(paths["store"], env, "--run", RUN, "--checkpoints", "3", "--corrupt-newest")
            assert f"corrupted {RUN} step 60" in out
            observe = lambda: daemon.observe(instance, paths["store"], RUN)
            assert daemon.wait_until(lambda: daemon.settled(observe(), {keys[2]}), timeout_s=300), observe()
            outcomes = observe()
            runs = runs_by_partition(instance)
            evaluation = [instance.get_latest_materialization_event(AssetKey("evaluation"))]
    finally:
        daemon.stop(process)
    report(capsys, "SQLite, default sensor intervals (pipelines/instance/local.yaml):", outcomes)

    clean, corrupt = outcomes[:2], outcomes[2]
    assert [o.key for o in outcomes] == keys
    assert all(o.complete and o.check_passed for o in clean) and corrupt.blocked
    # one run per asset group and partition, each with an honest status
    for key in keys[:2]:
        assert [r.status for r in runs[("validate_checkpoint", key)]] == [DagsterRunStatus.SUCCESS]
        assert [r.status for r in runs[("evaluation", key)]] == [DagsterRunStatus.SUCCESS]
        assert [r.status for r in runs[("archived,compressed", key)]] == [DagsterRunStatus.SUCCESS]
    [blocked] = runs[("validate_checkpoint", keys[2])]
    assert blocked.status == DagsterRunStatus.FAILURE
    assert not any(key == keys[2] for (what, key) in runs if what != "validate_checkpoint")
    # no evaluator is configured for this model: its trainer's metrics are the evaluation
    metadata = evaluation[0].asset_materialization.metadata
    assert metadata["source"].value == "the trainer's recorded metrics" and f"{RUN}/val_loss" in metadata


def test_daemon_and_webserver_on_postgresql_with_the_production_instance(lifecycle, capsys):
    """Two runs of the same model: ``regressor-a`` has no evaluator (trainer metrics),
    ``regressor-b`` is mapped to the demo's TinyLM evaluator, which cannot load it: its
    evaluations fail, each in its own run and partition, while its compression and
    archival succeed. Checked through the webserver's GraphQL endpoint too."""
    paths, env = lifecycle
    shutil.copy(os.path.join(INSTANCE, "production.yaml"), os.path.join(paths["home"], "dagster.yaml"))
    port = free_port()
    with postgres_server() as pg:
        env.update(pg.env())
        env["CKPTFLOW_SENSOR_INTERVAL_S"] = "5"  # shorter ticks from configuration, to keep CI quick
        env["CKPTFLOW_EVALUATORS"] = json.dumps({"regressor-b": "pipelines.demo.evaluate:evaluate"})
        os.environ.update(pg.env())  # this process reads the same instance config
        daemon.prepare_instance(paths["home"])
        logs = os.path.join(paths["home"], "daemon.log"), os.path.join(paths["home"], "webserver.log")
        processes = [
            daemon.start([daemon.dagster_bin("dagster-daemon"), "run", "-w", "workspace.yaml"], env, logs[0]),
            daemon.start(
                [daemon.dagster_bin("dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
                env,
                logs[1],
            ),
        ]
        try:
            with DagsterInstance.from_config(paths["home"]) as instance:
                assert daemon.wait_for_daemon(instance), open(logs[0]).read()[-3000:]
                for seed, run in enumerate(("regressor-a", "regressor-b")):
                    # different seeds: runs with equal weights would share (and both damage) the newest chunk
                    args = ("--run", run, "--seed", str(seed), "--checkpoints", "3", "--corrupt-newest")
                    daemon.train_other_model(paths["store"], env, *args)
                a_keys = [checkpoint_key("regressor-a", s) for s in STEPS]
                b_keys = [checkpoint_key("regressor-b", s) for s in STEPS]

                seen: dict = {}

                def done() -> bool:
                    a = daemon.observe(instance, paths["store"], "regressor-a")
                    b = daemon.observe(instance, paths["store"], "regressor-b")
                    evaluations = instance.get_status_by_partition(
                        AssetKey("evaluation"), b_keys[:2], checkpoints_partitions
                    )
                    tagged = [r for r in instance.get_runs() if r.tags.get("dagster/partition") in b_keys]
                    seen.update(
                        a=daemon.settled(a, {a_keys[2]}),
                        b_clean=[sorted(o.after_s) for o in b[:2]],
                        b_blocked=b[2].blocked,
                        b_evaluations=evaluations,
                        b_tagged=[r.tags.get(FAILURE_TAG, "")[:40] for r in tagged],
                    )
                    return (
                        seen["a"]
                        and all(set(o.after_s) == {"checkpoint", "compressed", "archived"} for o in b[:2])
                        and b[2].blocked
                        and set((evaluations or {}).values()) == {AssetPartitionStatus.FAILED}
                        and sum(1 for r in tagged if FAILURE_TAG in r.tags) == 3  # 2 evaluations, 1 validation
                    )

                assert daemon.wait_until(done, timeout_s=300), seen
                outcomes = daemon.observe(instance, paths["store"], "regressor-a")
                runs = runs_by_partition(instance)
            graphql = _graphql(port)
        finally:
            for process in processes:
                daemon.stop(process)
            for name in pg.env():
                os.environ.pop(name, None)
    report(capsys, "PostgreSQL (pipelines/instance/production.yaml), 5 s sensor intervals:", outcomes)

    for key in b_keys[:2]:
        [evaluation] = runs[("evaluation", key)]
        assert evaluation.status == DagsterRunStatus.FAILURE
        assert evaluation.tags[FAILURE_TAG].startswith("evaluation: evaluator pipelines.demo.evaluate:evaluate failed")
        assert [r.status for r in runs[("archived,compressed", key)]] == [DagsterRunStatus.SUCCESS]
    [blocked] = runs[("validate_checkpoint", b_keys[2])]
    assert blocked.tags[FAILURE_TAG].startswith(f"checkpoint: integrity check blocked {b_keys[2]}")

    stats = {n["assetKey"]["path"][0]: n["partitionStats"] for n in graphql["assetNodes"]}
    assert stats["checkpoint"] == {"numPartitions": 6, "numMaterialized": 4, "numFailed": 2, "numMaterializing": 0}
    assert stats["evaluation"]["numMaterialized"] == 2 and stats["evaluation"]["numFailed"] == 2
    assert stats["archived"]["numMaterialized"] == 4 and stats["archived"]["numFailed"] == 0
    failed = {(r["jobName"], r["tags"]["dagster/partition"]) for r in graphql["runs"] if r["status"] == "FAILURE"}
    assert failed == {("validate_checkpoint", a_keys[2]), ("validate_checkpoint", b_keys[2])} | {
        ("__ASSET_JOB", k) for k in b_keys[:2]
    }


QUERY = """
query Lifecycle($assets: [AssetKeyInput!]) {
  assetNodes(assetKeys: $assets) {
    assetKey { path }
    partitionStats { numPartitions numMaterialized numFailed numMaterializing }
  }
  runsOrError(limit: 100) {
    ... on Runs { results { runId jobName status tags { key value } } }
  }
}
"""


def _graphql(port: int) -> dict:
    """The lifecycle as the webserver reports it: partition counts per asset, and the runs."""
    url = f"http://127.0.0.1:{port}/graphql"
    assert daemon.wait_until(lambda: _answers(url), timeout_s=120), "the webserver did not answer"
    assets = [{"path": [name]} for name in ("checkpoint", "evaluation", "compressed", "archived")]
    body = json.dumps({"query": QUERY, "variables": {"assets": assets}}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    data = json.loads(urllib.request.urlopen(request, timeout=60).read())["data"]
    runs = [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in data["runsOrError"]["results"]]
    return {"assetNodes": data["assetNodes"], "runs": runs}


def _answers(url: str) -> bool:
    try:
        body = json.dumps({"query": "{ version }"}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        return "version" in json.loads(urllib.request.urlopen(request, timeout=5).read()).get("data", {})
    except OSError:
        return False
