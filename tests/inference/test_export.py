"""transformer-export: the safetensors directory (its files, model card, permissions and round trip) and
CTranslate2 against our own decoder. The tests marked slow use a trained model; the others an untrained one."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.helpers import run_main
from transformer import Translator
from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.cli import export as export_command
from transformer.data.sources import load_split_text
from transformer.data.tokenizer import Tokenizer, train_sentencepiece
from transformer.inference import model_card, model_directory, pretrained
from transformer.inference.ctranslate2 import export_ctranslate2
from transformer.inference.pretrained import load_pretrained, save_pretrained
from transformer.model import build_model

try:
    import ctranslate2  # noqa: F401

    FORMATS = ["safetensors", "ctranslate2"]
except ImportError:  # the [export] extra is not installed
    FORMATS = ["safetensors"]


def _sources(trained_checkpoint, n=120):
    _, _, config = model_from_checkpoint(load_checkpoint(trained_checkpoint))
    sources, references = load_split_text(config.data, "validation")
    return sources[:n], references[:n]


@pytest.mark.slow
def test_safetensors_directory_round_trip_translates_identically(trained_checkpoint, tmp_path):
    out = tmp_path / "exported"
    result = subprocess.run(
        [sys.executable, "-m", "transformer.cli.export", str(trained_checkpoint), str(out), "--format", "safetensors"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    files = ["README.md", "config.json", "export-manifest.json", "model.safetensors", "spm.model"]
    assert sorted(p.name for p in out.iterdir()) == files
    digests = {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files if name != "export-manifest.json"
    }
    assert json.loads((out / "export-manifest.json").read_text()) == {
        "format": "safetensors",
        "files": files,
        "sha256": digests,
    }
    card = (out / "README.md").read_text()  # the trained checkpoint's own validation scores
    last = load_checkpoint(trained_checkpoint)["metrics"]["val_history"][-1]
    assert f"at step {last['step']}: BLEU {last['bleu']:.2f}, chrF {last['chrf']:.2f}" in card
    meta = json.loads((out / "config.json").read_text())
    assert meta["format"] == "transformer-nmt" and meta["config"]["model"]["d_model"] == 96
    # No pickle anywhere: the weights are plain safetensors, the tied matrix stored once.
    from safetensors.torch import load_file

    stored = load_file(out / "model.safetensors")
    assert len({"src_embed.weight", "tgt_embed.weight", "output.weight"} & set(stored)) == 1

    sources, _ = _sources(trained_checkpoint)
    original = Translator.from_checkpoint(trained_checkpoint, device="cpu", precision="fp32")
    loaded = Translator.from_pretrained(out, device="cpu", precision="fp32")
    assert loaded.model.output.weight is loaded.model.tgt_embed.weight  # tying survives
    for beam in (1, 5):
        assert loaded.translate(sources, beam_size=beam) == original.translate(sources, beam_size=beam)
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name]), name

    # The CLI takes the directory where it takes a checkpoint.
    cli = subprocess.run(
        [sys.executable, "-m", "transformer.cli.translate", str(out), "--beam", "1"],
        input="\n".join(sources[:5]) + "\n",
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == original.translate(sources[:5], beam_size=1)

    again = subprocess.run(
        [sys.executable, "-m", "transformer.cli.export", str(trained_checkpoint), str(out), "--format", "safetensors"],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already exists (an earlier export); pass --force" in again.stderr


def test_from_pretrained_refuses_what_it_cannot_read(untrained_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file, and holds no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"did you mean .*checkpoints/best.pt\?"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="owner/name"):
        load_pretrained(tmp_path / "nowhere")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"add_source_bos": False, "unk_token": "<unk>"}))
    with pytest.raises(CheckpointError, match=r'not a transformer-nmt model \(no "format" key; another tool'):
        load_pretrained(other)
    (other / "model.bin").write_bytes(b"\0" * 16)  # what transformer-export --format ctranslate2 writes
    with pytest.raises(CheckpointError, match=r"other: a CTranslate2 model .*\(ctranslate2.Translator\)"):
        load_pretrained(other)
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    out = save_pretrained(model, tokenizer, config, tmp_path / "m")
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["model"]["d_model"] = 128
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"config.json: its config says model.d_model=128 but its weights are 64"):
        load_pretrained(out)


def test_from_pretrained_refuses_weights_or_tokenizer_damaged_after_the_export(untrained_checkpoint, tmp_path):
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    out = save_pretrained(model, tokenizer, config, tmp_path / "m")
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["decode"]["beam_size"] = 3  # config.json stays free to edit
    (out / "config.json").write_text(json.dumps(meta))
    assert load_pretrained(out)[2].decode.beam_size == 3
    for name in ("model.safetensors", "spm.model"):
        pristine = (out / name).read_bytes()
        damaged = bytearray(pristine)
        damaged[len(damaged) * 2 // 3] ^= 0x10  # one bit, inside the weights or the pieces
        (out / name).write_bytes(bytes(damaged))
        with pytest.raises(
            CheckpointError,
            match=rf"m/{name}: damaged: its bytes no longer match the SHA-256 the "
            r"export recorded in export-manifest.json",
        ):
            load_pretrained(out)
        (out / name).write_bytes(pristine)
    manifest = json.loads((out / "export-manifest.json").read_text())
    del manifest["sha256"]  # an export from before digests: loads unchecked
    (out / "export-manifest.json").write_text(json.dumps(manifest))
    damaged = bytearray((out / "model.safetensors").read_bytes())
    damaged[-5] ^= 0x10
    (out / "model.safetensors").write_bytes(bytes(damaged))
    load_pretrained(out)


def _ct2_translator(directory):
    ctranslate2 = pytest.importorskip("ctranslate2")
    return ctranslate2.Translator(str(directory), device="cpu", inter_threads=1, intra_threads=2)


@pytest.mark.slow
def test_ctranslate2_greedy_equals_ours_on_a_trained_model(trained_checkpoint, tmp_path):
    pytest.importorskip("ctranslate2")
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(trained_checkpoint))
    out = export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    assert {"model.bin", "config.json", "spm.model"} <= {p.name for p in out.iterdir()}
    sources, _ = _sources(trained_checkpoint)
    ours = Translator(model, tokenizer, config, torch.device("cpu"), "fp32")
    pieces = [tokenizer.src.encode(s, out_type=str) for s in sources]
    results = _ct2_translator(out).translate_batch(pieces, beam_size=1, max_decoding_length=64)
    theirs = tokenizer.decode_tgt([tokenizer.tgt.piece_to_id(r.hypotheses[0]) for r in results])
    expected = ours.translate(sources, beam_size=1, max_len_a=0.0, max_len_b=64)
    assert sum(a == b for a, b in zip(theirs, expected)) >= 0.99 * len(sources)


@pytest.mark.parametrize("pre_norm,tied,joint", [(True, True, True), (False, False, True), (True, False, False)])
def test_ctranslate2_scores_equal_ours_for_each_architecture(pre_norm, tied, joint, untrained_checkpoint, tmp_path):
    """Pre- and post-norm, tied or not, joint or separate vocabularies: CTranslate2's forced-decoding
    log-probabilities of the same references equal `Translator.score` (float32)."""
    pytest.importorskip("ctranslate2")
    _, base_tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    sources, references = _sources(untrained_checkpoint, n=40)
    if joint:
        tokenizer = base_tokenizer
    else:
        target_model = train_sentencepiece(
            references * 5, vocab_size=150, model_type="bpe", character_coverage=1.0, sample=10_000
        )
        tokenizer = Tokenizer(base_tokenizer.src_model_bytes, target_model)
        assert not tokenizer.joint
    config.model.pre_norm, config.model.tie_embeddings = pre_norm, tied
    torch.manual_seed(3)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).eval()
    with torch.no_grad():  # LayerNorms away from their (1, 0) start, so that a swapped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    out = export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    ours = Translator(model, tokenizer, config, torch.device("cpu"), "fp32").score(sources, references)
    src_pieces = [tokenizer.src.encode(s, out_type=str) for s in sources]
    tgt_pieces = [tokenizer.tgt.encode(r, out_type=str) for r in references]
    theirs = [sum(r.log_probs) for r in _ct2_translator(out).score_batch(src_pieces, tgt_pieces)]
    assert theirs == pytest.approx(ours, rel=1e-3, abs=1e-2)


def test_export_cli_refuses_bad_requests(untrained_checkpoint, tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "transformer.cli.export", *map(str, args)], capture_output=True, text=True
        )

    result = run(untrained_checkpoint, tmp_path / "x", "--format", "hf", "--quantization", "int8")
    assert result.returncode == 2 and "--quantization applies to --format ctranslate2 only" in result.stderr
    precious = tmp_path / "run"
    (precious / "checkpoints").mkdir(parents=True)
    (precious / "checkpoints" / "keep.pt").write_bytes(b"x")
    result = run(untrained_checkpoint, precious, "--format", "hf", "--force")  # --force replaces exports only
    assert result.returncode == 2 and "is not an exported model (it holds checkpoints)" in result.stderr
    assert (precious / "checkpoints" / "keep.pt").read_bytes() == b"x"
    result = run(tmp_path / "missing.pt", tmp_path / "y", "--format", "hf")
    assert result.returncode == 2 and "missing.pt" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "y").exists()


# ----- without training: an untrained tiny model ------------------------------------------------------


def _export(capsys, checkpoint, out, fmt):
    return run_main(export_command.main, capsys, checkpoint, out, "--format", fmt)


def test_safetensors_and_its_old_name_hf_write_the_same_loadable_directory(untrained_checkpoint, tmp_path, capsys):
    code, stdout, stderr = _export(capsys, untrained_checkpoint, tmp_path / "new", "safetensors")
    assert code == 0 and stderr == "" and "(safetensors)" in stdout
    code, stdout, stderr = _export(capsys, untrained_checkpoint, tmp_path / "old", "hf")
    assert code == 0 and "(safetensors)" in stdout
    assert stderr.count("\n") == 1 and "--format hf is deprecated" in stderr and "use --format safetensors" in stderr
    sentences = ["Der Hund läuft.", "Die Katze schläft."]
    expected = Translator.from_checkpoint(untrained_checkpoint, device="cpu").translate(
        sentences, beam_size=1, max_len_b=8
    )
    for name in ("new", "old"):
        assert json.loads((tmp_path / name / model_directory.MANIFEST_FILE).read_text())["format"] == "safetensors"
        loaded = Translator.from_pretrained(tmp_path / name, device="cpu")
        assert loaded.translate(sentences, beam_size=1, max_len_b=8) == expected
    assert _tree_bytes(tmp_path / "new") == _tree_bytes(tmp_path / "old")


def _tree_bytes(directory):
    """The files of an export; the card names its directory, so it is compared without that name (and
    the manifest without the card's digest). The weights must be the same bytes: safetensors wrote its
    header's metadata in an order that changed from one write to the next (a hash map), so two exports
    of one checkpoint had different digests until the export sorted it."""

    def content(path):
        if path.name == model_directory.MANIFEST_FILE:
            manifest = json.loads(path.read_text())
            assert manifest["sha256"].pop(model_directory.CARD_FILE) == model_directory.file_sha256(
                path.parent / model_directory.CARD_FILE
            )
            return manifest
        return path.read_bytes().replace(directory.name.encode(), b"DIR")

    return {p.name: content(p) for p in directory.iterdir()}


def test_the_safetensors_header_is_written_sorted_and_still_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {f"w{i}": torch.full((2, i + 1), float(i)) for i in range(12)}
    tensors["half"] = torch.ones(3, dtype=torch.float16)  # the writer orders by dtype, then name
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"zeta": "1", "alpha": "2", "mid": "3"})
    size = path.stat().st_size
    pretrained.canonical_safetensors_header(path)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    # each tensor's own keys are sorted too (the writer puts dtype, shape, data_offsets in that order)
    assert raw[8 : 8 + length] == json.dumps(header, sort_keys=True, separators=(",", ":")).encode().ljust(length)
    assert path.stat().st_size == size and (8 + length) % 8 == 0  # the data did not move
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items()) and len(loaded) == 13
    with safe_open(path, "pt") as opened:
        assert opened.metadata() == {"zeta": "1", "alpha": "2", "mid": "3"}


def test_the_export_has_a_model_card(untrained_checkpoint, tmp_path, capsys):
    out = tmp_path / "de-en-model"
    assert _export(capsys, untrained_checkpoint, out, "safetensors")[0] == 0
    card = (out / "README.md").read_text()
    assert "README.md" in json.loads((out / model_directory.MANIFEST_FILE).read_text())["files"]
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert "library_name" not in meta and meta["language"] == ["de", "en"]  # ours is not on PyPI: none named
    (result,) = meta["model-index"][0]["results"]  # no test recorded: the last validation's scores
    assert meta["model-index"][0]["name"] == "de-en-model" and result["task"]["type"] == "translation"
    assert result["dataset"]["split"] == "validation"
    assert [(m["type"], m["value"]) for m in result["metrics"]] == [("bleu", 12.35), ("chrf", 40.5)]
    assert meta["tags"] == ["translation"] and meta["pipeline_tag"] == "translation" and meta["license"]
    model, _, _ = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    parameters = sum(p.numel() for p in model.parameters())
    for text in (
        "Source `de`, target `en`",
        "toy corpus",
        "data preset `toy`",
        f"{parameters:,} parameters",
        "2 encoder and 2 decoder layers, d_model 64",
        "at step 10: BLEU 12.35, chrF 40.50",
        'Translator.from_pretrained("de-en-model")',
        "transformer-translate de-en-model",
        "`transformers` cannot load this directory",
    ):
        assert text in body, text


def test_the_model_card_names_a_hub_dataset_and_says_when_there_are_no_scores(untrained_checkpoint):
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    config.data.embedded, config.data.name, config.data.hub_id = False, "wmt14", "wmt/wmt14"
    config.data.src_lang, config.data.tgt_lang = "no", "en"  # "no" is not YAML's false here
    card = model_card.model_card(model, tokenizer, config, "m", {})
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["language"] == ["no", "en"] and meta["datasets"] == ["wmt/wmt14"]
    assert "https://huggingface.co/datasets/wmt/wmt14" in card and "records no validation scores" in card


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_have_the_permissions_of_any_new_file(fmt, umask, untrained_checkpoint, tmp_path, capsys):
    """safetensors writes through an owner-only temporary file, mkdtemp makes owner-only directories:
    an export follows the umask as a file created normally does."""
    old = os.umask(umask)
    try:
        (tmp_path / "plain").write_text("x")
        (tmp_path / "plain-dir").mkdir()
        assert _export(capsys, untrained_checkpoint, tmp_path / "model", fmt)[0] == 0
    finally:
        os.umask(old)
    file_mode, dir_mode = (tmp_path / "plain").stat().st_mode, (tmp_path / "plain-dir").stat().st_mode
    assert (tmp_path / "model").stat().st_mode == dir_mode
    modes = {p.name: oct(p.stat().st_mode) for p in (tmp_path / "model").iterdir()}
    assert modes == dict.fromkeys(modes, oct(file_mode))
