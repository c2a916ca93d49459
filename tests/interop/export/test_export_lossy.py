"""A lossy archive copy leaves only when asked, and everything made from it says so.

The copy (bf16 weights, 8-bit optimizer moments) of a real transformers BERT checkpoint:
``export`` of it (safetensors file, model directory, ``--format dcp``) is refused
without ``allow_lossy`` / ``--allow-lossy``, the way restore refuses it; with the opt-in
every artifact carries the copy's ``lossy`` record: the safetensors header, config.json,
the model card, the CLI's output, the DCP sidecar. Importing that DCP export keeps the
mark: the new checkpoint restores only with ``allow_lossy`` and reports ``result.lossy``; so
does importing a model directory that ``save_pretrained`` wrote again (config.json keeps it).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, BertConfig, BertModel

from ckptflow import Checkpointer, NoValidCheckpointError, lifecycle
from ckptflow.catalog import checkpoints as catalog
from ckptflow.chunks.lossy import ArchiveCodec
from ckptflow.errors import CkptflowError, LossyCopyError
from ckptflow.interop.export import ExportOptions, export_dcp, export_safetensors, model_metadata
from ckptflow.interop.importers import import_checkpoint
from ckptflow.store import open_store
from support.cli import run_cli

RUN = "lossy"
BERT = {
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**BERT)).eval()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(torch.randint(0, 96, (2, 8)))
    (out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()).backward()  # every parameter steps
    optim.step()
    return {"model": model, "optim": optim}


@pytest.fixture
def archived(tmp_path):
    """(hot, archive, the saved model's weights rounded as the copy holds them, the copy's lossy record)."""
    hot, arc = open_store(str(tmp_path / "hot")), open_store(str(tmp_path / "arc"))
    saved = state()
    with Checkpointer(hot, RUN) as ck:
        ck.save(1, saved, metadata=model_metadata(saved["model"]))
    report = lifecycle.archive(hot, arc, RUN, 1, codec=ArchiveCodec.parse("bf16+int8"))
    assert report.ok, report.problems
    rounded = {k: v.detach().bfloat16().float() for k, v in saved["model"].state_dict().items()}
    return hot, arc, rounded, dict(catalog.read_manifest(arc, RUN, 1).lossy)


def test_export_of_a_lossy_copy_needs_the_opt_in(archived, tmp_path):
    _, arc, _, _ = archived
    for export, out in ((export_safetensors, tmp_path / "m.safetensors"), (export_safetensors, tmp_path / "dir")):
        with pytest.raises(LossyCopyError, match=r"lossy archive copy \(weights rounded to bf16.*allow_lossy=True"):
            export(arc, RUN, out)
        with pytest.raises(LossyCopyError, match="--allow-lossy"):
            export(arc, RUN, out, step=1)
        assert not out.exists()
    with pytest.raises(LossyCopyError, match="allow_lossy=True"):
        export_dcp(arc, RUN, tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists()


def test_every_artifact_of_a_lossy_export_carries_the_mark(archived, tmp_path):
    _, arc, rounded, lossy = archived
    file = tmp_path / "m.safetensors"
    result = export_safetensors(arc, RUN, file, allow_lossy=True)
    assert result.lossy == lossy
    with safe_open(str(file), "pt") as f:
        assert json.loads(f.metadata()["ckptflow.chunks.lossy"]) == lossy
        assert torch.equal(f.get_tensor("pooler.dense.weight"), rounded["pooler.dense.weight"])

    directory = tmp_path / "dir"
    export_safetensors(arc, RUN, directory, allow_lossy=True)
    config = json.loads((directory / "config.json").read_text())
    assert config["ckptflow_lossy"] == lossy
    card = (directory / "README.md").read_text()
    assert "Lossy copy" in card and "weights rounded to bf16" in card and lossy["source_digest"] in card
    assert "- lossy" in card  # a tag the hub can filter on
    loaded = AutoModel.from_pretrained(directory)  # still an ordinary model directory
    assert torch.equal(loaded.state_dict()["pooler.dense.weight"], rounded["pooler.dense.weight"])

    result = export_dcp(arc, RUN, tmp_path / "dcp", allow_lossy=True)
    assert result.lossy == lossy
    assert json.loads((tmp_path / "dcp" / "ckptflow.json").read_text())["lossy"] == lossy


def test_importing_a_lossy_dcp_export_keeps_the_mark(archived, tmp_path):
    _, arc, rounded, lossy = archived
    export_dcp(arc, RUN, tmp_path / "dcp", allow_lossy=True)
    store = str(tmp_path / "imported")
    import_checkpoint(store, "again", 5, tmp_path / "dcp")
    assert dict(catalog.read_manifest(open_store(store), "again", 5).lossy) == lossy
    target = state(seed=3)
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    with Checkpointer(store, "again") as ck:
        with pytest.raises(NoValidCheckpointError, match="lossy archive copy.*allow_lossy=True"):
            ck.restore(target)
        assert all(torch.equal(v, before[k]) for k, v in target["model"].state_dict().items())
        result = ck.restore(target, allow_lossy=True)
    assert result.lossy == lossy and result.step == 5
    assert all(torch.equal(v, rounded[k]) for k, v in target["model"].state_dict().items())
    # and out again: the mark goes with it
    with pytest.raises(LossyCopyError):
        export_dcp(store, "again", tmp_path / "dcp2")
    assert export_dcp(store, "again", tmp_path / "dcp2", allow_lossy=True).lossy == lossy


def test_cli_export_of_a_lossy_copy(archived, tmp_path, capsys):
    _, arc, _, _ = archived
    for fmt_args in ((), ("--format", "dcp")):
        out = tmp_path / f"out{len(fmt_args)}"
        code, _, err = run_cli(capsys, "export", arc.url, "--run", RUN, "--out", out, *fmt_args)
        assert code == 2 and "lossy archive copy" in err and "--allow-lossy" in err and not out.exists()
        code, stdout, err = run_cli(capsys, "export", arc.url, "--run", RUN, "--out", out, "--allow-lossy", *fmt_args)
        assert code == 0, err
        assert "LOSSY copy (weights rounded to bf16" in stdout and "not the exact checkpoint" in err


def test_importing_a_lossy_safetensors_or_model_directory_keeps_the_mark(archived, tmp_path):
    _, arc, _, lossy = archived
    export_safetensors(arc, RUN, tmp_path / "m.safetensors", allow_lossy=True)
    export_safetensors(arc, RUN, tmp_path / "dir", allow_lossy=True, options=ExportOptions(max_shard_bytes=20_000))
    store = open_store(str(tmp_path / "imported"))
    for step, src in ((1, tmp_path / "m.safetensors"), (2, tmp_path / "dir")):
        assert import_checkpoint(store, "again", step, src).lossy == lossy
        assert dict(catalog.read_manifest(store, "again", step).lossy) == lossy


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda mark: {**mark, "dropped": "optim"}, "'dropped' is not a list"),
        (lambda mark: {**mark, "kept_exact": 5}, "'kept_exact' is not a list"),  # imported, then describe() raised
        (lambda mark: None, "must be a JSON object"),  # read as no mark: the copy imported as exact
    ],
    ids=["dropped", "kept_exact", "null"],
)
def test_a_malformed_lossy_mark_is_refused_at_import(archived, tmp_path, edit, why):
    _, arc, _, _ = archived
    export_dcp(arc, RUN, tmp_path / "dcp", allow_lossy=True)
    sidecar = tmp_path / "dcp" / "ckptflow.json"
    doc = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**doc, "lossy": edit(doc["lossy"])}))
    with pytest.raises(CkptflowError, match=f"lossy archive copy.*{why}"):
        import_checkpoint(str(tmp_path / "imported"), "again", 1, tmp_path / "dcp")
    assert not (tmp_path / "imported" / "runs").exists()


def test_a_lossy_copy_is_never_promoted_and_the_refusal_says_what_to_promote(archived, tmp_path):
    from ckptflow.errors import PromotionError
    from ckptflow.interop.registry import Registry
    from ckptflow.lifecycle.promote import PromotionRequest, promote

    hot, _, _, _ = archived
    export_dcp(archived[1], RUN, tmp_path / "dcp", allow_lossy=True)
    store = open_store(str(tmp_path / "imported"))
    import_checkpoint(store, "again", 5, tmp_path / "dcp")
    registry = Registry(store)
    with pytest.raises(PromotionError) as refused:
        promote(store, registry, PromotionRequest(model="bert", checkpoint=("again", 5)))
    text = str(refused.value)
    assert "lossy archive copy" in text and "promote the exact commit" in text
    assert catalog.read_manifest(hot, RUN, 1).digest in text and "--allow-lossy" in text
    assert registry.versions("bert") == []  # nothing registered


def test_promotion_by_metric_passes_over_a_lossy_copy_for_the_exact_commit(archived, tmp_path):
    """A lossy copy imported back for evaluation shares its source's metrics and verdict (and
    is newer): promotion by metric chose it, then refused it, so no promotion by metric could
    succeed while it was there. It is never a candidate; the exact commit is promoted."""
    from ckptflow.interop.registry import Registry
    from ckptflow.lifecycle.promote import PromotionRequest, promote
    from ckptflow.lifecycle.validate import validate

    hot, arc, _, lossy = archived
    export_dcp(arc, RUN, tmp_path / "dcp", allow_lossy=True)
    import_checkpoint(hot, "again", 5, tmp_path / "dcp")
    for run, step in ((RUN, 1), ("again", 5)):
        assert validate(hot, run, step)["ok"]
        lifecycle.evaluate(hot, hot, run, step, lambda tensors, config: {"val_loss": 0.25})
    version = promote(hot, Registry(hot), PromotionRequest("bert", stage="stable")).registered
    assert (version.run, version.step, version.manifest_digest) == (RUN, 1, lossy["source_digest"])


def test_importing_a_lossy_model_directory_saved_again_by_transformers_keeps_the_mark(archived, tmp_path):
    """``save_pretrained`` keeps config.json's ``ckptflow_lossy`` but writes a new safetensors
    header without ``ckptflow.chunks.lossy``: the import read only the header, so the new
    checkpoint restored without ``allow_lossy`` as if it were exact."""
    _, arc, rounded, lossy = archived
    export_safetensors(arc, RUN, tmp_path / "dir", allow_lossy=True)
    AutoModel.from_pretrained(tmp_path / "dir").save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["ckptflow_lossy"] == lossy
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as f:
        assert "ckptflow.chunks.lossy" not in (f.metadata() or {})
    store = str(tmp_path / "imported")
    assert import_checkpoint(store, "again", 5, tmp_path / "again").lossy == lossy
    assert dict(catalog.read_manifest(open_store(store), "again", 5).lossy) == lossy
    target = {"model": state(seed=3)["model"]}
    with Checkpointer(store, "again") as ck:
        with pytest.raises(NoValidCheckpointError, match="lossy archive copy.*allow_lossy=True"):
            ck.restore(target)
        assert ck.restore(target, allow_lossy=True).lossy == lossy
    assert all(torch.equal(v, rounded[k]) for k, v in target["model"].state_dict().items())


def test_a_model_directory_whose_config_and_header_name_different_lossy_copies_is_refused(archived, tmp_path):
    _, arc, _, lossy = archived
    export_safetensors(arc, RUN, tmp_path / "dir", allow_lossy=True)
    config = json.loads((tmp_path / "dir" / "config.json").read_text())
    config["ckptflow_lossy"] = {**lossy, "source_digest": "0" * 64}
    (tmp_path / "dir" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CkptflowError, match="config.json and .*model.safetensors name different lossy copies"):
        import_checkpoint(str(tmp_path / "imported"), "again", 5, tmp_path / "dir")
    assert not (tmp_path / "imported" / "runs").exists()
