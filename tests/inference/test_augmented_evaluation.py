"""transformer-evaluate --augment: one row per noised copy beside the clean score, each copy's sources,
references and hypotheses written beside the checkpoint as scored, the same copies for the same seed, and the
refusals. An untrained checkpoint proves these (the scores are compared with the files, not judged); one slow test
shows the issue's finding on the session's trained tiny model."""

import json
import shutil

import pytest

from tests.helpers import assert_one_line_refusal, run_main
from transformer.cli.evaluate import main
from transformer.data.augment import augment_pairs

SOURCES = [f"Der große Hund Nummer {i} rennt schnell über die grüne Wiese." for i in range(12)]
REFERENCES = [f"The big dog number {i} runs quickly over the green meadow." for i in range(12)]
COMMON = ["--beam", 1, "--max-len-b", 4, "--precision", "fp32", "--device", "cpu"]


@pytest.fixture
def pair(tmp_path, untrained_checkpoint):
    """A copy of the untrained checkpoint (its results are written beside it) and a source/reference pair."""
    checkpoint = tmp_path / "m.pt"
    shutil.copy(untrained_checkpoint, checkpoint)
    src, ref = tmp_path / "in.de", tmp_path / "in.en"
    src.write_text("".join(line + "\n" for line in SOURCES), encoding="utf-8")
    ref.write_text("".join(line + "\n" for line in REFERENCES), encoding="utf-8")
    return checkpoint, src, ref


def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _copy(folder, variant: str, kind: str):
    """A file of the noised copy `variant` of in.de: its src, ref, hyp or json."""
    return folder / f"m.in.de.aug-{variant}.beam1.{kind}"


def test_each_variant_is_a_row_beside_the_clean_score_and_its_files_hold_what_was_scored(pair, capsys):
    checkpoint, src, ref = pair
    names = ["upper", "title", "typos", "nopunct", "mix"]
    rc, out, err = run_main(main, capsys, checkpoint, "--src", src, "--ref", ref, *COMMON, "--augment", ",".join(names))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        "in.de: 12 sentences, beam 1; noised copies with --augment-seed 1, typos in 10% of the words longer "
        "than three letters"
    )
    assert lines[1].split() == ["variant", "BLEU", "chrF", "vs", "clean"]
    folder = checkpoint.parent
    clean = json.loads((folder / "m.in.de.beam1.json").read_text())
    assert "augment" not in clean
    assert lines[2].split() == ["clean", f"{clean['bleu']:.2f}", f"{clean['chrf']:.2f}"]
    for line, name in zip(lines[3:], names):
        scores = json.loads(_copy(folder, name, "json").read_text())
        delta = f"{scores['bleu'] - clean['bleu']:+.2f}"
        assert line.split() == [name, f"{scores['bleu']:.2f}", f"{scores['chrf']:.2f}", delta]
        assert len(line) == len(lines[1])  # the columns line up under the header
        assert scores["augment"] == name and scores["augment_seed"] == 1
        assert scores["typo_rate"] == 0.1 if name in ("typos", "mix") else "typo_rate" not in scores
        noised_sources, noised_references = augment_pairs(SOURCES, REFERENCES, name, seed=1)
        assert _lines(_copy(folder, name, "src")) == noised_sources
        assert _lines(_copy(folder, name, "ref")) == noised_references
        assert len(_lines(_copy(folder, name, "hyp"))) == 12
    assert _lines(_copy(folder, "upper", "ref")) == [line.upper() for line in REFERENCES]
    assert _lines(_copy(folder, "upper", "src")) == [line.upper() for line in SOURCES]
    assert _lines(_copy(folder, "typos", "ref")) == REFERENCES  # typos are the source's alone
    assert _lines(_copy(folder, "typos", "src")) != SOURCES
    assert _lines(_copy(folder, "nopunct", "ref")) == [line.removesuffix(".") for line in REFERENCES]
    assert lines[8] == f"BLEU signature: {clean['bleu_signature']}"
    assert lines[10].startswith("hypotheses: ") and lines[10].count(".hyp") == 6


def test_the_seed_chooses_the_noised_copies(pair, capsys):
    checkpoint, src, ref = pair
    typos = checkpoint.parent / "m.in.de.aug-typos.beam1.src"
    copies = []
    for seed in ("1", "2", "1"):
        rc, out, err = run_main(
            main, capsys, checkpoint, "--src", src, "--ref", ref, *COMMON, "--augment", "typos", "--augment-seed", seed
        )
        assert rc == 0, err
        assert f"--augment-seed {seed}," in out.splitlines()[0]
        copies.append(_lines(typos))
    assert copies[0] == copies[2] != copies[1]
    assert copies[1] == augment_pairs(SOURCES, REFERENCES, "typos", seed=2)[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--augment", "upper,caps"],
            "argument --augment: 'caps' is not a variant; the variants: upper, title, typos, nopunct, mix; "
            "see transformer-evaluate --help",
        ),
        (
            ["--augment", "upper,upper"],
            "argument --augment: 'upper' is given twice; give each variant once; see transformer-evaluate --help",
        ),
        (
            ["--augment", "upper", "--beam", "2", "--alpha", "1,2"],
            "--augment scores one evaluation beside its noised copies: leave out --directions and give one --alpha",
        ),
        (["--augment-seed", "3"], "--augment-seed 3: it seeds the noised copies; give --augment too"),
        (["--augment", "upper", "--augment-seed", "-1"], "--augment-seed -1: give a whole number of 0 or more"),
    ],
)
def test_bad_augment_flags_are_refused_in_one_line(pair, capsys, flags, message):
    checkpoint, src, ref = pair
    rc, out, err = run_main(main, capsys, checkpoint, "--src", src, "--ref", ref, *COMMON, *flags)
    assert rc == 2 and out == ""
    assert assert_one_line_refusal(err, "transformer-evaluate") == f"transformer-evaluate: error: {message}"
    assert not list(checkpoint.parent.glob("*.hyp"))  # refused before translating


@pytest.mark.slow
def test_a_model_trained_on_sentence_case_falls_apart_on_the_upper_cased_copy(trained_checkpoint, tmp_path, capsys):
    """Issue 73's finding on the session's trained tiny model (no augmentation): the upper-cased copy, scored
    against upper-cased references, loses most of the clean BLEU, typos lose some, and the clean row is the plain
    evaluation's."""
    checkpoint = tmp_path / "best.pt"
    shutil.copy(trained_checkpoint, checkpoint)
    flags = ["--beam", 1, "--device", "cpu", "--precision", "fp32"]
    rc, out, err = run_main(main, capsys, checkpoint, *flags, "--augment", "upper,typos")
    assert rc == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:5]}
    clean, noised = float(rows["clean"][0]), float(rows["upper"][0])
    assert clean > 10 and noised < clean / 2 and float(rows["typos"][0]) < clean, out  # measured: 93.7, 0.0, 88.1
    assert float(rows["upper"][2]) == pytest.approx(noised - clean, abs=0.011)
    plain = json.loads((tmp_path / "best.test.beam1.json").read_text())
    assert plain["bleu"] == pytest.approx(clean, abs=0.005) and "augment" not in plain
    references = _lines(tmp_path / "best.test.aug-upper.beam1.ref")
    assert references and all(line == line.upper() for line in references)
    assert any(line != line.lower() for line in references)  # letters, upper-cased
