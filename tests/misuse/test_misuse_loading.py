"""Files that would make loading a model allocate without bound, leak the training machine's paths or end in a
traceback (issue 71, classes 4a and 6): a stored config whose sizes are not those of its weights (a checkpoint's,
an export's config.json, a resumed run's), one that asks for a position table of millions of rows, an export's
absolute paths, symbolic link loops where a command reads or writes, an empty spm.model and a config.json nested
too deeply. Each ends in one line naming the file (and the key), exit 2, before any model is built and with
nothing written. Nothing here trains: the model is an untrained tiny one."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import FAST, ROOT, assert_one_line_refusal, compose_config, run_main, write_untrained_checkpoint
from transformer.checkpoint import (
    CheckpointError,
    check_config_matches_weights,
    load_checkpoint,
    save_checkpoint,
    tensor_shapes,
)
from transformer.cli import export as export_command
from transformer.cli.average import main as average_main
from transformer.cli.translate import main as translate_main
from transformer.config import MAX_POSITIONS
from transformer.model import build_model
from transformer.training.resume import StartingPoint
from transformer.training.trainer import Trainer

TRANSLATE, EXPORT, AVERAGE = "transformer-translate", "transformer-export", "transformer-average"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A run's best.pt (an untrained tiny model: d_model 64, d_ff 128, 2 + 2 layers), its safetensors export
    `exported`, and a source file to translate."""
    root = tmp_path_factory.mktemp("loading")
    write_untrained_checkpoint(root / "run" / "checkpoints" / "best.pt")
    (root / "in.de").write_text("Der Hund.\n")
    code = export_command.main(
        [str(root / "run" / "checkpoints" / "best.pt"), str(root / "exported"), "--format", "safetensors"]
    )
    assert code == 0
    return root


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _edited_checkpoint(workspace: Path, tmp_path: Path, model_keys: dict) -> Path:
    """A copy of best.pt whose stored config says `model_keys` (the weights as they were)."""
    state = load_checkpoint(workspace / "run" / "checkpoints" / "best.pt")
    state["config"]["model"].update(model_keys)
    path = tmp_path / "edited.pt"
    save_checkpoint(state, path)
    return path


def _edited_export(workspace: Path, tmp_path: Path, model_keys: dict) -> Path:
    """A copy of the export whose config.json says `model_keys` (config.json is free to edit: no digest)."""
    out = tmp_path / "edited"
    shutil.copytree(workspace / "exported", out)
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["model"].update(model_keys)
    (out / "config.json").write_text(json.dumps(meta))
    return out


# ----- 1. a stored config's sizes are its weights' (and the position table, which no weight records, is bounded)

# (id, what the stored config says, the message expected): each builds nothing
CONFIG_DAMAGE = [
    (
        "max_positions",
        {"max_positions": 200_000},  # before: loaded, a table of 200000 x 64 floats (5000000: 5 GB) with exit 0
        rf"config is invalid: model.max_positions=200000 must be from 1 to {MAX_POSITIONS} \(",
    ),
    (
        "d_model",
        {"d_model": 1024},
        r"model.d_model=1024 but its weights are 64 wide \(tgt_embed.weight is \(\d+, 64\)\)",
    ),
    ("d_ff", {"d_ff": 4096}, r"model.d_ff=4096 but its weights are 128 wide \(encoder_layers.0.feed_forward.up.weight"),
    ("encoder_layers", {"encoder_layers": 48}, r"model.encoder_layers=48 but its weights hold 2 encoder layers"),
    ("decoder_layers", {"decoder_layers": 48}, r"model.decoder_layers=48 but its weights hold 2 decoder layers"),
]


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
@pytest.mark.parametrize("case", CONFIG_DAMAGE, ids=[c[0] for c in CONFIG_DAMAGE])
def test_a_stored_config_that_is_not_its_weights_is_refused_before_a_model_is_built(
    case, kind, workspace, tmp_path, capsys, monkeypatch
):
    _, keys, pattern = case
    edited = (_edited_checkpoint if kind == "checkpoint" else _edited_export)(workspace, tmp_path, keys)
    built = []
    monkeypatch.setattr("transformer.model.Transformer.__init__", lambda *a, **k: built.append(1) or 1 / 0)
    code, out, err = run_main(translate_main, capsys, edited, "--input", workspace / "in.de")
    assert code == 2, (out, err)
    named = edited.name if kind == "checkpoint" else "edited/config.json"
    line = assert_one_line_refusal(err, TRANSLATE, pattern)
    said = "config is invalid" if "max_positions" in keys else "config says"  # the schema's bound, or the weights
    assert re.search(rf"{re.escape(named)}: its (stored )?{said}", line), line
    assert "max_positions" in keys or line.endswith("; the file is damaged or was edited")
    assert out == "" and built == []


@pytest.mark.parametrize("case", CONFIG_DAMAGE, ids=[c[0] for c in CONFIG_DAMAGE])
def test_exporting_such_a_checkpoint_writes_nothing(case, workspace, tmp_path, capsys):
    _, keys, pattern = case
    edited = _edited_checkpoint(workspace, tmp_path, keys)
    before = _tree(tmp_path)
    code, _, err = run_main(export_command.main, capsys, edited, tmp_path / "out", "--format", "safetensors")
    assert code == 2
    assert_one_line_refusal(err, EXPORT, pattern)
    assert _tree(tmp_path) == before and not (tmp_path / "out").exists()


# (id, how the stored weights are damaged, the message expected)
WEIGHT_DAMAGE = [
    (
        "no-feed-forward",
        lambda w: w.pop("encoder_layers.0.feed_forward.up.weight"),
        r"its weights hold no encoder_layers.0.feed_forward.up.weight matrix; the file is damaged",
    ),
    (
        "vocabulary",  # the tokenizer's 120 pieces, an embedding of 50 rows
        lambda w: w.update({f"{side}_embed.weight": torch.zeros(50, 64) for side in ("src", "tgt")}),
        r"its tokenizer has \d+ target pieces but its weights embed 50 \(tgt_embed.weight is \(50, 64\)\)",
    ),
]


@pytest.mark.parametrize("case", WEIGHT_DAMAGE, ids=[c[0] for c in WEIGHT_DAMAGE])
def test_weights_that_are_not_the_stored_model_are_refused_by_name(case, workspace, tmp_path, capsys):
    _, damage, pattern = case
    state = load_checkpoint(workspace / "run" / "checkpoints" / "best.pt")
    damage(state["model"])
    save_checkpoint(state, tmp_path / "edited.pt")
    code, _, err = run_main(translate_main, capsys, tmp_path / "edited.pt", "--input", workspace / "in.de")
    assert code == 2
    assert_one_line_refusal(err, TRANSLATE, r"edited.pt: " + pattern)


def test_a_resumed_run_whose_checkpoint_config_is_not_its_weights_builds_nothing(workspace):
    """trainer.resume: the run takes the checkpoint's model settings (adopt_resumed_config), then builds the
    model; one whose config was edited is refused before it is built (model.max_positions is the run's own)."""
    state = load_checkpoint(workspace / "run" / "checkpoints" / "best.pt")
    cfg = compose_config(FAST + ["model.d_model=1024", f"model.max_positions={MAX_POSITIONS}"])  # as adopted
    trainer = SimpleNamespace(
        cfg=cfg, data=SimpleNamespace(tokenizer=_tokenizer_of(state)), runtime=SimpleNamespace(device="cpu")
    )
    with pytest.raises(CheckpointError, match=r"last.pt: its config says model.d_model=1024 but its weights are 64"):
        Trainer.build_model(trainer, StartingPoint(resume=state, path=Path("last.pt")))


def _tokenizer_of(state):
    from transformer.data.tokenizer import Tokenizer

    return Tokenizer.from_state_dict(state["tokenizer"])


# Every preset, tied or not, one vocabulary (pre-norm) or two (post-norm): the check passes the weights of
# the model the config builds (on the meta device: shapes without memory), stored as a checkpoint or as
# safetensors stores them.
@pytest.mark.parametrize("preset", ["tiny", "small", "base", "big"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("joint", [True, False])
def test_the_check_refuses_no_model_that_a_config_builds(preset, tied, joint):
    flags = [f"model.tie_embeddings={str(tied).lower()}", f"model.pre_norm={str(joint).lower()}"]
    cfg = compose_config([f"model={preset}", *flags])
    vocab = SimpleNamespace(src_vocab_size=8000, tgt_vocab_size=8000 if joint else 9000, joint=joint)
    with torch.device("meta"):
        model = build_model(cfg.model, vocab.src_vocab_size, vocab.tgt_vocab_size, joint)
    shapes = tensor_shapes(model.state_dict())
    check_config_matches_weights(cfg.model, shapes, vocab, "x.pt")
    cfg.model.max_positions = MAX_POSITIONS
    check_config_matches_weights(cfg.model, shapes, vocab, "x.pt")
    if tied:  # a safetensors file stores a tied matrix once, under any one of its names
        once = {"tgt_embed.weight", *(["src_embed.weight"] if joint else [])}
        check_config_matches_weights(cfg.model, {k: v for k, v in shapes.items() if k not in once}, vocab, "x")


# ----- 2. an export holds no absolute path of the machine it was trained on


def test_an_export_holds_no_absolute_path_of_the_training_machine(workspace, tmp_path, capsys, monkeypatch):
    state = load_checkpoint(workspace / "run" / "checkpoints" / "best.pt")
    home = tmp_path / "home" / "alice"
    state["config"]["data"].update(
        name="custom", embedded=False, path=str(home / "corpus"), cache_dir=str(home / "cache")
    )
    state["config"]["trainer"].update(init_from=str(home / "base.pt"), resume=str(home / "run" / "last.pt"))
    state["config"]["run_dir"] = str(home / "runs" / "today")
    save_checkpoint(state, tmp_path / "best.pt")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(
        export_command.main, capsys, tmp_path / "best.pt", tmp_path / "out", "--format", "safetensors"
    )
    assert code == 0, err
    files = _tree(tmp_path / "out")
    assert set(files) == {"README.md", "config.json", "export-manifest.json", "model.safetensors", "spm.model"}
    for name, data in files.items():
        for path in {str(tmp_path), str(Path.home()), os.getcwd(), "/alice/"}:
            assert path.encode() not in data, (name, path)
    config = json.loads(files["config.json"])["config"]
    assert (config["data"]["path"], config["data"]["cache_dir"], config["run_dir"]) == ("corpus", "cache", "today")
    assert (config["trainer"]["init_from"], config["trainer"]["resume"]) == ("base.pt", "last.pt")
    assert "Local files in `corpus`" in files["README.md"].decode()
    code, out, err = run_main(translate_main, capsys, tmp_path / "out", "--input", workspace / "in.de")
    assert code == 0 and out, err  # the export still loads


# ----- 3. symbolic link loops, an empty spm.model, a config.json nested too deeply


@pytest.fixture
def loop(tmp_path) -> Path:
    """`loop`, a symbolic link to `back`, which links to `loop`."""
    (tmp_path / "loop").symlink_to("back")
    (tmp_path / "back").symlink_to("loop")
    return tmp_path / "loop"


LOOP = r"is a symbolic link loop \(a link that leads back to itself, directly or through other links\)"

# (id, the command, its arguments ({loop}: the link loop, {ckpt}: best.pt, {ws}: the workspace), the message)
LOOP_CASES = [
    ("translate-checkpoint", "translate", ["{loop}", "--input", "{ws}/in.de"], rf"loop: {LOOP}, not a checkpoint"),
    (
        "translate-under-a-loop",
        "translate",
        ["{loop}/m", "--input", "{ws}/in.de"],
        rf"loop/m: {LOOP}, not a checkpoint",
    ),
    ("average-input", "average", ["{loop}", "{ckpt}", "-o", "{tmp}/avg.pt"], rf"loop: {LOOP}, not a checkpoint"),
    ("average-output", "average", ["{ckpt}", "-o", "{loop}"], rf"-o .*loop: {LOOP}; remove the link or write"),
    ("export-target", "export", ["{ckpt}", "{loop}", "--format", "safetensors"], rf"loop: {LOOP}; remove the link"),
    ("export-checkpoint", "export", ["{loop}", "{tmp}/out", "--format", "safetensors"], rf"loop: {LOOP}, not a"),
]
COMMANDS = {
    "translate": (translate_main, TRANSLATE),
    "average": (average_main, AVERAGE),
    "export": (export_command.main, EXPORT),
}


@pytest.mark.parametrize("case", LOOP_CASES, ids=[c[0] for c in LOOP_CASES])
def test_a_symbolic_link_loop_is_said_as_such_in_one_line(case, loop, workspace, tmp_path, capsys):
    _, command, args, pattern = case
    ckpt = workspace / "run" / "checkpoints" / "best.pt"
    args = [a.format(loop=loop, ckpt=ckpt, ws=workspace, tmp=tmp_path) for a in args]
    main, prog = COMMANDS[command]
    code, out, err = run_main(main, capsys, *args)
    assert code == 2, (out, err)
    assert_one_line_refusal(err, prog, pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "loop"]  # nothing written


def test_a_run_directory_that_is_a_symbolic_link_loop_is_refused_in_one_line(loop, tmp_path, data_cache):
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.train", *FAST, "trainer.max_steps=1", f"hydra.run.dir={loop}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_line_refusal(proc.stderr, None, rf"hydra.run.dir=.*loop: {LOOP}; remove the link or choose another run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "loop"]


# (id, the damage done to a copy of the export, the message expected)
EXPORT_DAMAGE = [
    (
        "empty-spm-model",  # the manifest's digest of it removed too, as a hand-made directory has none
        lambda out: ((out / "spm.model").write_bytes(b""), (out / "export-manifest.json").unlink()),
        r"edited/spm.model: an empty file \(0 bytes\), not a SentencePiece model",
    ),
    (
        "deep-config-json",
        lambda out: (out / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        r"edited/config.json: nested too deeply to be read",
    ),
    (
        "deep-config-inside",  # valid JSON that json reads, nested in the config OmegaConf reads
        lambda out: _nest_in_config(out, 900),
        r"edited/config.json: nested too deeply to be read",
    ),
]


def _nest_in_config(out: Path, depth: int) -> None:
    meta = json.loads((out / "config.json").read_text())
    meta["config"]["decode"]["alpha_by_language"] = json.loads('{"a":' * depth + "1" + "}" * depth)
    (out / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case", EXPORT_DAMAGE, ids=[c[0] for c in EXPORT_DAMAGE])
def test_a_damaged_export_file_is_named_in_one_line(case, workspace, tmp_path, capsys):
    _, damage, pattern = case
    out = tmp_path / "edited"
    shutil.copytree(workspace / "exported", out)
    damage(out)
    before = _tree(tmp_path)
    code, stdout, err = run_main(translate_main, capsys, out, "--input", workspace / "in.de")
    assert code == 2, (stdout, err)
    assert_one_line_refusal(err, TRANSLATE, pattern)
    assert _tree(tmp_path) == before


def test_a_checkpoint_whose_config_nests_too_deeply_is_named_in_one_line(workspace, tmp_path, capsys):
    from transformer.training.resume import TrainingError, adopt_resumed_config

    state = load_checkpoint(workspace / "run" / "checkpoints" / "best.pt")
    nested = 1
    for _ in range(5000):
        nested = {"a": nested}
    state["config"]["decode"]["alpha_by_language"] = nested
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # torch.save pickles recursively; torch.load reads it back at any depth
    try:
        save_checkpoint(state, tmp_path / "deep.pt")
    finally:
        sys.setrecursionlimit(limit)
    state = load_checkpoint(tmp_path / "deep.pt")
    code, _, err = run_main(translate_main, capsys, tmp_path / "deep.pt", "--input", workspace / "in.de")
    assert code == 2
    assert_one_line_refusal(err, TRANSLATE, r"deep.pt: its stored config is nested too deeply to be read")
    with pytest.raises(TrainingError, match=r"deep.pt: its stored config is nested too deeply to be read"):
        adopt_resumed_config(compose_config(FAST), state, tmp_path / "deep.pt")
