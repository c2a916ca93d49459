"""Shared pytest fixtures: a tiny training state, a train step, store roots and Checkpointers."""

import uuid

import pytest

from ckptflow import Checkpointer

# The helper modules hold asserts: have pytest rewrite them like test modules.
pytest.register_assert_rewrite("support")

from support.states import tiny_state, tiny_train  # noqa: E402


@pytest.fixture
def tiny_state_factory():
    """Call as ``tiny_state_factory(seed=0)`` -> {"model", "optim", "sched", "extra"}."""
    return tiny_state


@pytest.fixture
def tiny_train_step():
    """Call as ``tiny_train_step(state, n=1)``: n AdamW steps + scheduler steps."""
    return tiny_train


@pytest.fixture
def ckpt_store_dir(tmp_path):
    """A fresh store root directory (inside pytest's tmp_path)."""
    return str(tmp_path / "store")


@pytest.fixture
def make_ck(ckpt_store_dir):
    """Factory for Checkpointers on the test's store; all are closed at teardown."""
    made = []

    def make(run="r", root=None, **kwargs):
        ck = Checkpointer(root or ckpt_store_dir, run=run, **kwargs)
        made.append(ck)
        return ck

    yield make
    for ck in made:
        ck.close()


# ---- S3: a real S3 API server (moto) on 127.0.0.1 --------------------------------------
@pytest.fixture(scope="session")
def s3_endpoint():
    """Start moto's standalone server once per session on a free port; its endpoint URL.

    Dummy credentials and a region go into the environment so boto3 (and dagster-aws)
    talk to it exactly as they would to AWS, and can never reach a real account.
    """
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.setenv(name, "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_client):
    """A fresh, empty bucket for this test."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_store_url(s3_endpoint, s3_bucket):
    """``s3://bucket/prefix?endpoint=…`` of a fresh bucket, for anything that takes a URL."""
    return f"s3://{s3_bucket}/ckpts?endpoint={s3_endpoint}"


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    """A fresh store root on each backend: a local directory, then a bucket on moto."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_store_url")


# ---- MLflow: a real tracking server on 127.0.0.1 ---------------------------------------------
@pytest.fixture(scope="session")
def mlflow_tracking_uri(tmp_path_factory):
    """One ``mlflow server`` per session (SQLite backend, local artifact root); its URL.
    MLflow's own HTTP retries are cut to one short try so a test of failures does not wait
    minutes; the mirror's retries are what the tests exercise."""
    from support.mlflow_server import mlflow_server

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        env.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        with mlflow_server(str(tmp_path_factory.mktemp("mlflow"))) as url:
            yield url
