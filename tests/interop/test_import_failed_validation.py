"""An export made despite a failed validation verdict (``allow_failed``) does not import as a
clean checkpoint.

The export carries the verdict (safetensors header ``ckptflow.failed_validation``, a model
directory's config.json ``ckptflow_failed_validation``, a DCP export's ``ckptflow.json``).
The import ignored it: the model that failed validation came back as a new commit with no
verdict, which validation passed (its own bytes verify), so export and promotion took it.
Now the import refuses it, naming the verdict and the opt-in; with ``allow_failed`` the
new commit carries the verdict in its metadata and as its validation verdict, failed, which
validating it again keeps, so export and promotion refuse it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, BertConfig, BertModel

from ckptflow import Checkpointer, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.errors import FailedValidationError, PromotionError
from ckptflow.interop.export import export_dcp, export_safetensors, model_metadata
from ckptflow.interop.importers import import_checkpoint
from ckptflow.interop.registry import Registry
from ckptflow.lifecycle.promote import PromotionRequest, promote
from ckptflow.store import open_store
from support.cli import run_cli
from support.corrupt import chunk_path, flip_byte, tensor_chunk

RUN = "v"
BERT = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture
def failed_exports(tmp_path):
    """({kind: path}: a model directory, a .safetensors file and a DCP directory exported with
    allow_failed from a BERT commit whose validation failed; the verdict)."""
    root = str(tmp_path / "store")
    torch.manual_seed(0)
    model = BertModel(BertConfig(**BERT)).eval()
    with Checkpointer(root, RUN) as ck:
        ck.save(1, {"model": model, "extra": torch.full((64,), 1.0)}, metadata=model_metadata(model))
    damaged = chunk_path(root, tensor_chunk(root, RUN, 1, "extra"))
    flip_byte(damaged)
    verdict = lifecycle.validate(open_store(root), RUN, 1)
    assert not verdict["ok"]
    flip_byte(damaged)  # repaired, not validated again: the verdict stands, and the DCP export reads "extra" too
    out = {"dir": tmp_path / "dir", "file": tmp_path / "m.safetensors", "dcp": tmp_path / "dcp"}
    export_safetensors(root, RUN, out["dir"], step=1, allow_failed=True)
    export_safetensors(root, RUN, out["file"], step=1, allow_failed=True)
    export_dcp(root, RUN, out["dcp"], step=1, allow_failed=True)
    return out, verdict


@pytest.mark.parametrize("kind", ["dir", "file", "dcp"])
def test_an_export_made_despite_a_failed_verdict_is_refused_naming_it(failed_exports, tmp_path, kind):
    out, verdict = failed_exports
    with pytest.raises(FailedValidationError) as refused:
        import_checkpoint(str(tmp_path / "imported"), "again", 5, out[kind])
    message = str(refused.value)
    assert "failed validation" in message and verdict["problems"][0][:60] in message
    assert "--allow-failed" in message and "allow_failed=True" in message
    assert not (tmp_path / "imported" / "runs").exists()  # nothing committed


@pytest.mark.parametrize("kind", ["dir", "dcp"])
def test_imported_with_the_opt_in_it_keeps_the_verdict(failed_exports, tmp_path, kind):
    out, verdict = failed_exports
    store = open_store(str(tmp_path / "imported"))
    result = import_checkpoint(store, "again", 5, out[kind], allow_failed=True)
    assert result.failed_validation is not None and result.failed_validation["problems"] == verdict["problems"]
    manifest = catalog.read_manifest(store, "again", 5)
    assert manifest.metadata["import"]["failed_validation"]["recorded_at"] == verdict["recorded_at"]
    carried = lifecycle.read_record(store, lifecycle.Subject.of(manifest), "validation")
    assert carried is not None and carried["ok"] is False
    with pytest.raises(FailedValidationError, match="step 5 failed validation.*exported despite a failed validation"):
        export_safetensors(store, "again", tmp_path / "again.safetensors", step=5)
    registry = Registry(store)
    with pytest.raises(PromotionError, match="failed validation"):
        promote(store, registry, PromotionRequest(model="bert", checkpoint=("again", 5)))
    assert registry.versions("bert") == []
    again = lifecycle.validate(store, "again", 5)  # its own bytes verify; the verdict it carries stands
    assert again["ok"] is False and again["chunks_checked"] > 0
    assert (
        "exported despite a failed validation" in again["problems"][0]
        and verdict["problems"][0][:60] in again["problems"][0]
    )
    with pytest.raises(FailedValidationError):
        export_safetensors(store, "again", tmp_path / "again.safetensors", step=5)


def test_validating_an_import_made_with_the_opt_in_does_not_clear_the_verdict_it_carries(failed_exports, tmp_path):
    """The landing sensor validates every new commit within seconds. Validation checked
    only the commit's bytes, which verify, and wrote an ok verdict over the carried one:
    the opt-in import passed for a validated model as soon as the lifecycle saw it, and
    export and promotion took it. The carried verdict is the source's: clear it there
    (validate the source checkpoint again, export it anew)."""
    out, verdict = failed_exports
    store = open_store(str(tmp_path / "imported"))
    import_checkpoint(store, "again", 5, out["dir"], allow_failed=True)
    assert lifecycle.validate(store, "again", 5)["ok"] is False
    registry = Registry(store)
    with pytest.raises(PromotionError, match="failed validation"):
        promote(store, registry, PromotionRequest(model="bert", checkpoint=("again", 5)))


def test_a_model_directory_saved_again_by_transformers_keeps_the_verdict(failed_exports, tmp_path):
    """save_pretrained writes a header of its own (without ckptflow.failed_validation) and
    keeps config.json's keys: the config's copy of the verdict still refuses the import."""
    out, verdict = failed_exports
    AutoModel.from_pretrained(out["dir"]).save_pretrained(tmp_path / "again")
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        assert "ckptflow.failed_validation" not in (f.metadata() or {})
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["ckptflow_failed_validation"]["problems"] == verdict["problems"]
    with pytest.raises(FailedValidationError, match="--allow-failed"):
        import_checkpoint(str(tmp_path / "imported"), "again", 5, tmp_path / "again")
    assert not (tmp_path / "imported" / "runs").exists()


def test_the_weights_file_of_a_directory_saved_again_imported_on_its_own_keeps_the_verdict(failed_exports, tmp_path):
    """The file save_pretrained wrote carries no mark: importing it alone (a .safetensors
    file, not the directory) came back as a clean commit; the config.json beside it is read."""
    out, verdict = failed_exports
    AutoModel.from_pretrained(out["dir"]).save_pretrained(tmp_path / "again")
    weights = tmp_path / "again" / "model.safetensors"
    with pytest.raises(FailedValidationError, match="--allow-failed"):
        import_checkpoint(str(tmp_path / "imported"), "again", 5, weights)
    assert not (tmp_path / "imported" / "runs").exists()
    result = import_checkpoint(str(tmp_path / "imported"), "again", 5, weights, allow_failed=True)
    assert result.format == "safetensors" and result.failed_validation["problems"] == verdict["problems"]


@pytest.mark.parametrize("carried", [{"problems": "not a list"}, None], ids=["problems_not_a_list", "null"])
def test_a_malformed_carried_verdict_is_refused(failed_exports, tmp_path, carried):
    """A verdict edited to JSON null read as no verdict: the export imported as clean."""
    out, _ = failed_exports
    sidecar = out["dcp"] / "ckptflow.json"
    doc = json.loads(sidecar.read_text())
    doc["failed_validation"] = carried
    sidecar.write_text(json.dumps(doc))
    with pytest.raises(Exception, match="verdict it carries is malformed"):
        import_checkpoint(str(tmp_path / "imported"), "again", 5, out["dcp"], allow_failed=True)
    assert not (tmp_path / "imported" / "runs").exists()


def test_cli_import_of_an_export_made_despite_a_failed_verdict(failed_exports, tmp_path, capsys):
    out, _ = failed_exports
    root = str(tmp_path / "imported")
    code, _, err = run_cli(capsys, "import", root, "--run", "again", "--step", "5", out["dir"])
    assert code == 2 and "failed validation" in err and "--allow-failed" in err
    code, stdout, err = run_cli(capsys, "import", root, "--run", "again", "--step", "5", out["dir"], "--allow-failed")
    assert code == 0, err
    assert "imported" in stdout and "keeps that verdict" in err


def test_a_scrub_finds_no_damage_in_an_import_made_with_the_opt_in_and_finds_its_rot(failed_exports, tmp_path):
    """Scrub re-validates old commits and lists the failed ones as corrupt: an opt-in import,
    whose bytes verify, failed only by the verdict it carries, was listed as corrupt on every
    scrub (the scrub job failed: "no tier held a sound copy of their damaged chunks"). The
    carried verdict stands, and damage in its own bytes is still found, and said."""
    out, verdict = failed_exports
    root = tmp_path / "imported"
    store = open_store(str(root))
    import_checkpoint(store, "again", 5, out["dir"], allow_failed=True)
    report = lifecycle.scrub(store, older_than_s=0)
    assert report.checked == 1 and report.corrupt == []
    manifest = catalog.read_manifest(store, "again", 5)
    assert lifecycle.read_record(store, lifecycle.Subject.of(manifest), "validation")["ok"] is False
    flip_byte(chunk_path(str(root), next(iter(manifest.chunks))))
    [(run, step, why)] = lifecycle.scrub(store, older_than_s=0).corrupt
    assert (run, step) == ("again", 5) and "exported despite" not in why and why
