"""transformer-export: the safetensors directory round trip and CTranslate2 against our own decoder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from transformer import Translator
from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.data import load_split_text
from transformer.export import export_ctranslate2, load_pretrained, save_pretrained
from transformer.model import build_model
from transformer.tokenizer import Tokenizer, train_sentencepiece

pytestmark = pytest.mark.slow


def _sources(trained_checkpoint, n=120):
    _, _, config = model_from_checkpoint(load_checkpoint(trained_checkpoint))
    sources, references = load_split_text(config.data, "validation")
    return sources[:n], references[:n]


def test_hf_directory_round_trip_translates_identically(trained_checkpoint, tmp_path):
    out = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "transformer.export", str(trained_checkpoint), str(out),
                             "--format", "hf"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export-manifest.json", "model.safetensors",
                                                     "spm.model"]
    assert json.loads((out / "export-manifest.json").read_text()) == {
        "format": "hf", "files": ["config.json", "export-manifest.json", "model.safetensors", "spm.model"]}
    meta = json.loads((out / "config.json").read_text())
    assert meta["format"] == "transformer-nmt" and meta["config"]["model"]["d_model"] == 96
    # No pickle anywhere: the weights are plain safetensors, the tied matrix stored once.
    from safetensors.torch import load_file
    stored = load_file(out / "model.safetensors")
    assert len({"src_embed.weight", "tgt_embed.weight", "output.weight"} & set(stored)) == 1

    sources, _ = _sources(trained_checkpoint)
    original = Translator.from_checkpoint(trained_checkpoint, device="cpu", precision="fp32")
    loaded = Translator.from_pretrained(out, device="cpu", precision="fp32")
    assert loaded.model.output.weight is loaded.model.tgt_embed.weight          # tying survives
    for beam in (1, 5):
        assert loaded.translate(sources, beam_size=beam) == original.translate(sources, beam_size=beam)
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name]), name

    # The CLI takes the directory where it takes a checkpoint.
    cli = subprocess.run([sys.executable, "-m", "transformer.translate", str(out), "--beam", "1"],
                         input="\n".join(sources[:5]) + "\n", capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == original.translate(sources[:5], beam_size=1)

    again = subprocess.run([sys.executable, "-m", "transformer.export", str(trained_checkpoint), str(out),
                            "--format", "hf"], capture_output=True, text=True)
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr


def test_from_pretrained_refuses_what_it_cannot_read(trained_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file, and holds no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"did you mean .*checkpoints/best.pt\?"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="owner/name"):
        load_pretrained(tmp_path / "nowhere")
    model, tokenizer, config = model_from_checkpoint(load_checkpoint(trained_checkpoint))
    out = save_pretrained(model, tokenizer, config, tmp_path / "m")
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["model"]["d_model"] = 128
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_pretrained(out)


def _ct2_translator(directory):
    ctranslate2 = pytest.importorskip("ctranslate2")
    return ctranslate2.Translator(str(directory), device="cpu", inter_threads=1, intra_threads=2)


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
def test_ctranslate2_scores_equal_ours_for_each_architecture(pre_norm, tied, joint, trained_checkpoint, tmp_path):
    """Pre- and post-norm, tied or not, joint or separate vocabularies: CTranslate2's forced-decoding
    log-probabilities of the same references equal `Translator.score` (float32)."""
    pytest.importorskip("ctranslate2")
    _, base_tokenizer, config = model_from_checkpoint(load_checkpoint(trained_checkpoint))
    sources, references = _sources(trained_checkpoint, n=40)
    if joint:
        tokenizer = base_tokenizer
    else:
        target_model = train_sentencepiece(references * 5, vocab_size=150, model_type="bpe",
                                           character_coverage=1.0, sample=10_000)
        tokenizer = Tokenizer(base_tokenizer.src_model_bytes, target_model)
        assert not tokenizer.joint
    config.model.pre_norm, config.model.tie_embeddings = pre_norm, tied
    torch.manual_seed(3)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint).eval()
    with torch.no_grad():      # LayerNorms away from their (1, 0) start, so that a swapped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    out = export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    ours = Translator(model, tokenizer, config, torch.device("cpu"), "fp32").score(sources, references)
    src_pieces = [tokenizer.src.encode(s, out_type=str) for s in sources]
    tgt_pieces = [tokenizer.tgt.encode(r, out_type=str) for r in references]
    theirs = [sum(r.log_probs) for r in _ct2_translator(out).score_batch(src_pieces, tgt_pieces)]
    assert theirs == pytest.approx(ours, rel=1e-3, abs=1e-2)


def test_export_cli_refuses_bad_requests(trained_checkpoint, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "transformer.export", *map(str, args)],
                              capture_output=True, text=True)
    result = run(trained_checkpoint, tmp_path / "x", "--format", "hf", "--quantization", "int8")
    assert result.returncode == 2 and "--quantization applies to --format ctranslate2 only" in result.stderr
    precious = tmp_path / "run"
    (precious / "checkpoints").mkdir(parents=True)
    (precious / "checkpoints" / "keep.pt").write_bytes(b"x")
    result = run(trained_checkpoint, precious, "--format", "hf", "--force")   # --force replaces exports only
    assert result.returncode == 2 and "is not an exported model (it holds checkpoints)" in result.stderr
    assert (precious / "checkpoints" / "keep.pt").read_bytes() == b"x"
    result = run(tmp_path / "missing.pt", tmp_path / "y", "--format", "hf")
    assert result.returncode == 2 and "missing.pt" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "y").exists()
