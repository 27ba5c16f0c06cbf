"""Misuse of transformer-translate, transformer-evaluate and the Translator API that the table in
test_hostile.py cannot express: outputs that would overwrite an input however they are spelled, a full
disk, Ctrl-C, options that would be silently ignored, and scores that must not depend on the Unicode
normalization form of the references (issue 27)."""

import errno
import io
import math
import os
import re
import signal
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch

from tests.helpers import INTERRUPTIBLE, ROOT, assert_one_line_refusal, one_line, run_main
from transformer.cli.evaluate import main as evaluate_main
from transformer.cli.translate import main as translate_main
from transformer.inference.evaluate import output_paths
from transformer.inference.sampling import Sampling
from transformer.inference.translator import Translator
from transformer.kernels import Int8Linear

SOURCE = "Der Hund sieht die Katze.\nDie Frau gibt dem Mann das Buch.\n"


def _cli(*args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE):
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.cli.translate", *map(str, args)],
        cwd=ROOT,
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=300,
    )
    return proc.returncode, proc.stderr.decode("utf-8")


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.de"
    path.write_text(SOURCE)
    return path


# --- an output over an input: refused before anything is written, the input untouched


@pytest.mark.parametrize("spelling", ["same", "dot-dot", "relative", "symlink", "hard-link"])
def test_an_output_that_is_the_input_however_spelled_is_refused(
    untrained_checkpoint, source, tmp_path, capsys, monkeypatch, spelling
):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    output = {
        "same": source,
        "dot-dot": tmp_path / "sub" / ".." / "in.de",
        "relative": Path("../in.de"),
        "symlink": tmp_path / "link.de",
        "hard-link": tmp_path / "hard.de",
    }[spelling]
    if spelling == "symlink":
        output.symlink_to(source)
    if spelling == "hard-link":
        os.link(source, output)
    before = source.stat().st_mtime_ns
    code, out, err = run_main(translate_main, capsys, untrained_checkpoint, "--input", source, "--output", output)
    assert code == 2 and out == ""
    assert re.fullmatch(
        rf"transformer-translate: error: --output {re.escape(str(output))}: is the --input file "
        rf"{re.escape(str(source))}; writing the translations there would destroy it; choose another "
        r"file",
        one_line(err),
    )
    assert source.read_text() == SOURCE and source.stat().st_mtime_ns == before


def test_an_output_over_the_reference_the_checkpoint_or_a_model_file_is_refused(
    untrained_checkpoint, source, tmp_path, capsys
):
    reference = tmp_path / "ref.en"
    reference.write_text("The dog sees the cat.\nThe woman gives the man the book.\n")
    checkpoint_bytes = untrained_checkpoint.read_bytes()
    model_dir = tmp_path / "exported"  # refused before the directory is even read
    (model_dir / "tokenizer").mkdir(parents=True)
    (model_dir / "tokenizer" / "spm.model").write_bytes(b"pieces")
    for args, output, what in (
        (["--score-reference", reference], reference, "the --score-reference file"),
        ([], untrained_checkpoint, "the checkpoint"),
        ([], model_dir / "tokenizer" / "spm.model", f"the checkpoint {model_dir}"),
    ):
        checkpoint = model_dir if what.endswith(str(model_dir)) else untrained_checkpoint
        code, _, err = run_main(translate_main, capsys, checkpoint, "--input", source, *args, "--output", output)
        assert code == 2 and f"--output {output}: is {what}" in assert_one_line_refusal(err, "transformer-translate")
    assert untrained_checkpoint.read_bytes() == checkpoint_bytes
    assert (
        reference.read_text().startswith("The dog")
        and (model_dir / "tokenizer" / "spm.model").read_bytes() == b"pieces"
    )


def test_redirections_onto_the_input_are_refused(untrained_checkpoint, source):
    with open(source, "rb") as stdin:  # transformer-translate CK --output in.de < in.de
        code, err = _cli(untrained_checkpoint, "--output", source, stdin=stdin)
    assert code == 2
    assert_one_line_refusal(
        err, "transformer-translate", r"^transformer-translate: error: --output .*is the file on stdin"
    )
    with open(source, "ab") as stdout:  # transformer-translate CK --input in.de >> in.de
        code, err = _cli(untrained_checkpoint, "--input", source, stdout=stdout)
    assert code == 2 and re.fullmatch(
        r"transformer-translate: error: stdout is the --input file .*in.de; redirect "
        r"the output to another file .*",
        one_line(err),
    )
    assert source.read_text() == SOURCE


def test_evaluate_refuses_to_write_its_results_over_its_reference(untrained_checkpoint, tmp_path, source, capsys):
    checkpoint = tmp_path / "best.pt"
    checkpoint.symlink_to(untrained_checkpoint)
    hypotheses, scores = output_paths(checkpoint, source.name, 5)
    assert hypotheses == tmp_path / "best.in.de.beam5.hyp" and scores == tmp_path / "best.in.de.beam5.json"
    hypotheses.write_text("The dog sees the cat.\nThe woman gives the man the book.\n")  # an earlier run's, say
    code, out, err = run_main(evaluate_main, capsys, checkpoint, "--src", source, "--ref", hypotheses, "--beam", "5")
    assert code == 2 and out == ""
    assert re.fullmatch(
        r"transformer-evaluate: error: .*best.in.de.beam5.hyp: is the --ref file .*best.in.de.beam5"
        r".hyp; evaluate writes its results there, which would destroy it; move or rename that file",
        one_line(err),
    )
    assert hypotheses.read_text().startswith("The dog sees") and not scores.exists()


def test_evaluate_writes_a_hub_models_results_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_paths("owner/name", "test", 4) == (
        Path("owner--name.test.beam4.hyp"),
        Path("owner--name.test.beam4.json"),
    )


# --- a full disk, a reader that went away, Ctrl-C: one line, no traceback


def test_a_full_disk_on_stdout_is_one_line_that_says_writing(untrained_checkpoint, source):
    with open("/dev/full", "wb") as full:
        code, err = _cli(untrained_checkpoint, "--input", source, stdout=full)  # read whole
        assert code == 2
        assert one_line(err) == "transformer-translate: error: stdout: cannot write the output: No space left on device"
        with open(source, "rb") as text:
            pipe = subprocess.Popen(["cat"], stdin=text, stdout=subprocess.PIPE)
            code, err = _cli(untrained_checkpoint, stdin=pipe.stdout, stdout=full)  # streamed
            pipe.wait()
        assert code == 2 and "stdout: cannot write the output: No space left on device" in assert_one_line_refusal(
            err, "transformer-translate"
        )
    with open(source, "rb") as text:
        pipe = subprocess.Popen(["cat"], stdin=text, stdout=subprocess.PIPE)
        code, err = _cli(untrained_checkpoint, "--output", "/dev/full", stdin=pipe.stdout)  # streamed to --output
        pipe.wait()
    assert (
        code == 2
        and one_line(err)
        == "transformer-translate: error: --output /dev/full: cannot write the output: No space left on device"
    )


def test_a_full_disk_on_the_output_file_is_one_line(untrained_checkpoint, source, tmp_path, capsys, monkeypatch):
    import transformer.cli.streams as streams_module  # where the output file is opened

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_open = open

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        return FullDisk() if "w" in mode else real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(streams_module, "open", open_on_a_full_disk, raising=False)
    output = tmp_path / "out.en"
    for extra in ([], ["--score-reference", source]):
        code, out, err = run_main(
            translate_main, capsys, untrained_checkpoint, "--input", source, "--output", output, *extra
        )
        assert code == 2 and out == ""
        assert (
            one_line(err) == f"transformer-translate: error: --output {output}: cannot write the output: "
            "No space left on device"
        )


def test_ctrl_c_while_streaming_keeps_what_was_translated_and_exits_130(untrained_checkpoint):
    proc = subprocess.Popen(
        [sys.executable, "-m", "transformer.cli.translate", str(untrained_checkpoint), "--beam", "1"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **INTERRUPTIBLE,
    )
    try:
        proc.stdin.write(b"Der Hund.\n")
        proc.stdin.flush()
        first = proc.stdout.readline()  # translated; now waiting for the next line of the pipe
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first.strip() and out == b""
    assert proc.returncode == 130 and one_line(err.decode()) == "transformer-translate: interrupted"


def test_ctrl_c_in_translate_and_evaluate_is_one_line_and_130(untrained_checkpoint, source, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Translator, "translate_hypotheses", interrupted)
    code, out, err = run_main(translate_main, capsys, untrained_checkpoint, "--input", source)
    assert code == 130 and out == "" and one_line(err) == "transformer-translate: interrupted"
    monkeypatch.setattr(Translator, "translate", interrupted)
    code, out, err = run_main(evaluate_main, capsys, untrained_checkpoint, "--src", source, "--ref", source)
    assert code == 130 and out == "" and one_line(err) == "transformer-evaluate: interrupted"


# --- options the run would not use: one warning line, the run goes on


@pytest.mark.parametrize(
    "args, same_as, warning",
    [
        (["--temperature", "0.5"], [], "--temperature is ignored without --sampling"),
        (["--seed", "3"], [], "--seed is ignored without --sampling"),
        (["--beam", "1", "--alpha", "0.6"], ["--beam", "1"], "--alpha is ignored by greedy search and sampling"),
        (["--sampling", "topk:3", "--alpha", "0.6"], None, "--alpha is ignored by greedy search and sampling"),
        (
            ["--score-reference", "{ref}", "--nbest", "3", "--beam", "4"],
            ["--score-reference", "{ref}"],
            "--beam, --nbest are ignored with --score-reference (it scores the given translations; nothing is decoded)",
        ),
        (
            ["--score-reference", "{ref}", "--sampling", "topk:3", "--temperature", "0.7", "--seed", "4"],
            ["--score-reference", "{ref}"],
            "--sampling, --temperature, --seed are ignored with --score-reference",
        ),
        (
            ["--beam", "1", "--alpha", "0.6", "--temperature", "2"],
            ["--beam", "1"],
            "--temperature is ignored without --sampling; --alpha is ignored by greedy search",
        ),
    ],
)
def test_an_option_the_run_does_not_use_is_said_once(untrained_checkpoint, source, capsys, args, same_as, warning):
    code, out, err = run_main(
        translate_main, capsys, untrained_checkpoint, "--input", source, *[a.format(ref=source) for a in args]
    )
    assert code == 0 and out
    line = one_line(err)
    assert line.startswith("transformer-translate: warning: ") and warning in line
    if same_as is not None:  # the ignored options changed nothing
        code, expected, err = run_main(
            translate_main, capsys, untrained_checkpoint, "--input", source, *[a.format(ref=source) for a in same_as]
        )
        assert code == 0 and err == "" and out == expected


@pytest.mark.parametrize(
    "args",
    [
        ["--sampling", "topk:3", "--temperature", "0.7", "--seed", "2"],
        ["--beam", "2", "--alpha", "0.6", "--nbest", "2"],
        [],
    ],
)
def test_options_in_use_give_no_warning(untrained_checkpoint, source, capsys, args):
    code, out, err = run_main(translate_main, capsys, untrained_checkpoint, "--input", source, *args)
    assert code == 0 and out and err == ""


# --- the API: the same refusals as the command line


def test_score_refuses_what_translate_refuses(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    assert translator.score(iter(["Der Hund."]), ("The dog.",)) == translator.score(["Der Hund."], ["The dog."])
    for sentences, references, name, kind in (
        ("Hund", "dogs", "sentences", "str"),
        ([None], ["x"], "sentences", "NoneType"),
        (["Hund"], "dogs", "references", "str"),
        (["Hund"], [b"x"], "references", "bytes"),
        (None, ["x"], "sentences", "NoneType"),
        (["x"], 5, "references", "int"),
    ):
        with pytest.raises(
            TypeError,
            match=rf"^{name} must be a list of str \(got {kind}\); for one sentence write "
            r"score\(\[source\], \[reference\]\)$",
        ):
            translator.score(sentences, references)
    with pytest.raises(ValueError, match="2 sources but 1 references"):
        translator.score(["Der Hund.", "Die Katze."], ["The dog."])
    for bad in (0, -3, 1.5, math.nan):
        with pytest.raises(ValueError, match="batch_tokens"):
            translator.score(["Der Hund."], ["The dog."], batch_tokens=bad)


def test_non_finite_decoding_options_are_refused_by_the_api(untrained_checkpoint):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu")
    for options in ({"alpha": math.inf}, {"alpha": math.nan}, {"max_len_a": math.inf}, {"max_len_a": math.nan}):
        with pytest.raises(ValueError, match=f"{next(iter(options))}=(inf|nan): must be a finite number"):
            translator.translate(["Der Hund."], **options)
    for options in ({"temperature": math.inf}, {"temperature": math.nan}, {"top_p": math.nan}, {"top_p": math.inf}):
        with pytest.raises(ValueError, match="sampling needs"):
            Sampling(top_k=3, **options)


# --- scores compare like with like: the references' Unicode form does not count


def test_evaluate_scores_references_in_nfd_as_in_nfc_and_says_so(untrained_checkpoint, tmp_path, capsys, monkeypatch):
    checkpoint = tmp_path / "best.pt"  # its results are written beside it
    checkpoint.symlink_to(untrained_checkpoint)
    hypotheses = ["Ein Café in Köln öffnet früh.", "Der Mann fährt über die Brücke."]
    monkeypatch.setattr(Translator, "translate", lambda self, sentences, *request, **options: list(hypotheses))
    (tmp_path / "src").write_text("a\nb\n")
    reports = []
    for form in ("NFC", "NFD"):
        reference = tmp_path / f"ref.{form}"
        reference.write_text("".join(unicodedata.normalize(form, h) + "\n" for h in hypotheses), encoding="utf-8")
        code, out, err = run_main(evaluate_main, capsys, checkpoint, "--src", tmp_path / "src", "--ref", reference)
        assert code == 0, err
        reports.append(out.splitlines())
    assert (tmp_path / "ref.NFC").read_bytes() != (tmp_path / "ref.NFD").read_bytes()
    assert reports[0][0].startswith("src: BLEU 100.00  chrF 100.00") and reports[1][0].startswith(
        "src: BLEU 100.00  chrF 100.00"
    )
    assert reports[0][1].startswith("BLEU signature: ") and reports[0][1].endswith("|norm:nfc")
    assert reports[0][2].startswith("chrF signature: ") and reports[0][2].endswith("|norm:nfc")


def test_the_bench_scores_through_the_same_function(untrained_checkpoint, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from bench_ctranslate2 import _bleu

    hypotheses = ["Ein Café in Köln öffnet früh.", "Der Mann fährt über die Brücke."]
    reference = tmp_path / "ref"
    reference.write_text("".join(unicodedata.normalize("NFD", h) + "\n" for h in hypotheses), encoding="utf-8")
    assert _bleu(hypotheses, reference, str(untrained_checkpoint)) == 100.0


def test_the_bench_takes_each_commands_own_start_up_out_once(tmp_path, monkeypatch):
    """A row's translating time is its median less the same command's time on empty input, the beam
    left out; a second beam of the same command reuses the start-up measured for the first."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_ctranslate2

    calls = []

    def fake_timed(command, source_file, repeats):
        calls.append((command, Path(source_file).read_text()))
        return [0.25, 0.5, 0.75], []

    monkeypatch.setattr(bench_ctranslate2, "_timed", fake_timed)
    known = {}
    command = ["translate", "MODEL", "--beam", "5", "--quantize", "int8"]
    row = bench_ctranslate2._with_startup({"beam": 5, "seconds_median": 3.0}, command, 3, known)
    again = bench_ctranslate2._with_startup(
        {"beam": 1, "seconds_median": 2.0}, ["translate", "MODEL", "--beam", "1", "--quantize", "int8"], 3, known
    )
    assert calls == [(["translate", "MODEL", "--quantize", "int8"], "")]  # once, on empty input, no --beam
    assert row["startup_seconds"] == again["startup_seconds"] == 0.5
    assert row["translating_seconds"] == 2.5 and again["translating_seconds"] == 1.5


def _missing_cuda_device() -> tuple[str, str]:
    """A CUDA device this machine lacks, and the one line that refuses it."""
    if not torch.cuda.is_available():
        return "cuda", "--device cuda: CUDA is not available"
    count = torch.cuda.device_count()
    return f"cuda:{count}", f"--device cuda:{count}: there are {count} CUDA device(s) (0 to {count - 1})"


@pytest.mark.parametrize(
    "device, message",
    [
        _missing_cuda_device(),
        ("meta", "--device meta: must be auto, cpu, cuda or cuda:N"),
        ("CPU", "--device CPU: must be auto, cpu, cuda or cuda:N"),
        ("mps", "--device mps: must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_evaluate_refuses_a_device_it_cannot_use_in_one_line(untrained_checkpoint, source, device, message, capsys):
    """It gave 30-40-line tracebacks (an AssertionError from torch, a meta tensor that cannot be copied)."""
    code, out, err = run_main(
        evaluate_main, capsys, untrained_checkpoint, "--src", source, "--ref", source, "--device", device
    )
    assert (code, out, err) == (2, "", f"transformer-evaluate: error: {message}\n")


def test_evaluate_refuses_empty_files_and_keeps_the_results_of_another_file_of_the_same_name(
    untrained_checkpoint, tmp_path, capsys
):
    import json

    checkpoint = tmp_path / "best.pt"
    checkpoint.symlink_to(untrained_checkpoint)
    (tmp_path / "empty.de").write_text("")
    code, out, err = run_main(
        evaluate_main, capsys, checkpoint, "--src", tmp_path / "empty.de", "--ref", tmp_path / "empty.de"
    )
    assert (
        code == 2
        and one_line(err)
        == f"transformer-evaluate: error: {tmp_path / 'empty.de'}: no sentences to translate and score"
    )
    files = {}
    for folder, text in (("a", "Der Hund.\n"), ("b", "Die Katze.\nDer Mann.\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test.de").write_text(text)
        code, out, err = run_main(
            evaluate_main,
            capsys,
            checkpoint,
            "--src",
            tmp_path / folder / "test.de",
            "--ref",
            tmp_path / folder / "test.de",
            "--beam",
            "1",
            "--max-len-b",
            "3",
        )
        assert code == 0, err
        files[folder] = Path(re.search(r"scores: (.*)", out)[1])
    assert files["a"] == tmp_path / "best.test.de.beam1.json" and files["b"] != files["a"]  # not overwritten
    for folder, count in (("a", 1), ("b", 2)):
        scores = json.loads(files[folder].read_text())
        assert scores["src"] == str(tmp_path / folder / "test.de") and scores["sentences"] == count
    code, out, err = run_main(
        evaluate_main,
        capsys,
        checkpoint,
        "--src",
        tmp_path / "a" / "test.de",
        "--ref",
        tmp_path / "a" / "test.de",
        "--beam",
        "1",
        "--max-len-b",
        "3",
    )
    assert Path(re.search(r"scores: (.*)", out)[1]) == files["a"]  # the same file again: its name


@pytest.mark.parametrize(
    "closed, args, message",
    [
        (0, [], "stdin is closed; give --input FILE"),
        (1, ["--input", "{source}"], "stdout is closed; give --output FILE"),
    ],
)
def test_a_closed_stdin_or_stdout_is_said_in_one_line(untrained_checkpoint, source, closed, args, message):
    """`transformer-translate CK <&-` and `>&-` ended in an AttributeError traceback (after translating)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.cli.translate",
            str(untrained_checkpoint),
            *[a.format(source=source) for a in args],
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: os.close(closed),
        timeout=300,
    )
    assert proc.returncode == 2 and one_line(proc.stderr.decode()) == f"transformer-translate: error: {message}"


def test_scoring_a_reference_longer_than_the_model_says_it_was_cut(untrained_checkpoint, tmp_path):
    """Two long references after the same source scored the same, silently (their cut beginnings)."""
    source, reference = tmp_path / "in.de", tmp_path / "ref.en"
    source.write_text("der Hund .\nder Hund .\nder Hund .\n")
    reference.write_text("the dog .\n" + "dog " * 3000 + "\n" + "dog " * 6000 + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer.cli.translate",
            str(untrained_checkpoint),
            "--input",
            str(source),
            "--score-reference",
            str(reference),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 3
    assert re.fullmatch(
        r"transformer-translate: warning: 2 reference\(s\) longer than \d+ tokens were cut to the "
        r"model's maximum length: their scores cover only their beginning",
        one_line(proc.stderr),
    )


# --- input without bound (issue 71, class 2): a device, an endless line, a reader that fails ------------


def test_a_device_as_input_is_refused_in_one_line(untrained_checkpoint):
    # /dev/zero was read without end; a character device is refused before the model loads.
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.cli.translate", str(untrained_checkpoint), "--input", "/dev/zero"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert assert_one_line_refusal(proc.stderr, "transformer-translate") == (
        "transformer-translate: error: --input /dev/zero: is a character device; give a file of one sentence per line"
    )


def test_a_line_longer_than_the_limit_is_one_line_exit_2_from_a_file_and_from_a_pipe(untrained_checkpoint, tmp_path):
    from transformer.cli.streams import MAX_LINE_BYTES

    endless = tmp_path / "endless.txt"
    endless.write_bytes(b"Ein Hund.\n" + b"a" * (MAX_LINE_BYTES + 10))
    limit = f"line 2 is longer than {MAX_LINE_BYTES:,} bytes; give one sentence per line (is it a text file?)"
    command = [sys.executable, "-m", "transformer.cli.translate", str(untrained_checkpoint), "--beam", "1"]
    from_file = subprocess.run([*command, "--input", str(endless)], cwd=ROOT, capture_output=True, timeout=300)
    with open(endless, "rb") as data:  # a pipe: the streaming path, whose reader is a thread
        piped = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = piped.communicate(data.read(), timeout=300)
    assert from_file.returncode == 2 and piped.returncode == 2
    assert one_line(from_file.stderr.decode()) == f"transformer-translate: error: {endless}: {limit}"
    assert one_line(err.decode()) == f"transformer-translate: error: stdin: {limit}"
    assert out.decode().count("\n") == 1  # what came before the long line was translated and written


def test_a_failure_of_the_reader_thread_is_an_error_not_the_end_of_the_input():
    from transformer.cli.streams import stream_chunks
    from transformer.errors import UsageError

    class FailingStream:
        def __init__(self):
            self.lines = [b"eins\n", b"zwei\n"]

        def readline(self, limit=-1):
            if self.lines:
                return self.lines.pop(0)
            raise MemoryError  # e.g. an endless line without the limit

    chunks = stream_chunks(FailingStream())
    with pytest.raises(UsageError, match=r"^reading the input: MemoryError$"):
        seen = [lines for lines, _ in chunks]
    assert "seen" not in locals()  # nothing was taken for a complete input


# --- int8 output is a function of the sentence (issue 71, class 1)

INT8_SENTENCES = [
    "Der Hund sieht die Katze.",
    "Die Kuh.",
    "Oft ruft das Kind den Vogel, der auf dem hohen Baum neben dem alten Haus am Fluss sitzt.",
    "Ein Mann.",
    "Zwei Frauen gehen mit ihren Hunden durch den Park und reden über das Wetter.",
    "Das Buch liegt auf dem Tisch.",
    "Kinder spielen.",
    "Eine Gruppe von Menschen steht vor einem Gebäude und wartet auf den Bus.",
]


def test_an_int8_layers_output_row_is_a_function_of_that_row_alone():
    """Each row of an Int8Linear's output is bit-identical whatever the other rows are (PyTorch's dynamic
    int8 layer, one scale for the whole input, fails this), and close to the float layer's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    layer = Int8Linear.from_float(linear)
    rows = torch.randn(9, 64) * torch.linspace(0.1, 20.0, 9)[:, None]  # (9, 64): rows of very different sizes
    together = layer(rows)
    for i in range(len(rows)):
        assert torch.equal(layer(rows[i : i + 1]), together[i : i + 1])
        assert torch.equal(
            layer(torch.cat([rows[i : i + 1], rows * 3]))[:1], layer(torch.cat([rows[i : i + 1], -rows]))[:1]
        )
    batched = layer(rows.view(3, 3, 64))  # (3, 3, 96): any leading shape
    assert torch.equal(batched.view(9, 96), together)
    with torch.no_grad():
        exact = linear(rows)
    assert ((together - exact).abs().amax(dim=1) <= 0.03 * exact.abs().amax(dim=1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 3])
def test_an_int8_translation_is_the_same_alone_in_a_batch_and_across_worker_counts(trained_checkpoint, beam):
    """PyTorch's dynamic int8 layers scale a whole padded batch by one number, so a sentence's int8
    translation changed with its neighbours, the padding and the worker count; per-token scales make it a
    function of the sentence."""
    translator = Translator.from_checkpoint(trained_checkpoint, device="cpu", quantize="int8")

    def translate(sentences, **options):
        with torch.no_grad():
            return [h[0].tokens for h in translator.hypotheses(sentences, beam_size=beam, max_len_b=12, **options)]

    batched = translate(INT8_SENTENCES, workers=1)
    assert translate(INT8_SENTENCES, workers=2) == batched
    assert translate(INT8_SENTENCES, workers=1, batch_tokens=64) == batched  # other batches, other padding
    assert [translate([sentence], workers=1)[0] for sentence in INT8_SENTENCES] == batched
    assert translator.quantized


# --- ensembles that cannot agree, weights that overflow (issue 71, class 1)


@pytest.fixture(scope="module")
def opposite_direction_checkpoint(untrained_checkpoint, tmp_path_factory) -> Path:
    """The untrained checkpoint said to translate the other way (en -> de), with the same joint vocabulary."""
    from transformer.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(untrained_checkpoint)
    data = state["config"]["data"]
    data["src_lang"], data["tgt_lang"] = data["tgt_lang"], data["src_lang"]
    path = tmp_path_factory.mktemp("opposite") / "en-de.pt"
    save_checkpoint(state, path)
    return path


def test_an_ensemble_of_opposite_directions_is_refused_by_the_api_translate_and_evaluate(
    untrained_checkpoint, opposite_direction_checkpoint, source, tmp_path, capsys
):
    """A de-en and an en-de model over one joint SentencePiece model were accepted and mixed: garbage,
    rc 0, and a BLEU score for it."""
    from transformer.checkpoint import CheckpointError

    message = rf"{re.escape(str(opposite_direction_checkpoint))} translates en -> de but .* translates de -> en"
    with pytest.raises(CheckpointError, match=message):
        Translator.from_checkpoints([untrained_checkpoint, opposite_direction_checkpoint], device="cpu")
    code, out, err = run_main(
        translate_main, capsys, untrained_checkpoint, opposite_direction_checkpoint, "--input", source
    )
    assert code == 2 and out == ""
    assert_one_line_refusal(err, "transformer-translate", message)
    (tmp_path / "ref.en").write_text("The dog sees the cat.\nThe woman gives the man the book.\n")
    code, out, err = run_main(
        evaluate_main,
        capsys,
        untrained_checkpoint,
        opposite_direction_checkpoint,
        "--src",
        source,
        "--ref",
        tmp_path / "ref.en",
    )
    assert code == 2 and out == ""
    assert_one_line_refusal(err, "transformer-evaluate", message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.de", "ref.en"]  # no results written


@pytest.mark.parametrize("huge", [1e308, 1e-320])
def test_ensemble_weights_whose_sum_overflows_or_underflows_are_the_same_as_equal_weights(untrained_checkpoint, huge):
    """1e308,1e308 summed to infinity and normalised to 0,0: garbage with rc 0."""
    pair = Translator.from_checkpoints([untrained_checkpoint] * 2, weights=[1, 1], device="cpu", precision="fp32")
    extreme = Translator.from_checkpoints(
        [untrained_checkpoint] * 2, weights=[huge, huge], device="cpu", precision="fp32"
    )
    sentences = SOURCE.splitlines()
    with torch.no_grad():
        expected = [h[0] for h in pair.hypotheses(sentences, beam_size=2, max_len_b=6)]
        got = [h[0] for h in extreme.hypotheses(sentences, beam_size=2, max_len_b=6)]
    assert [h.tokens for h in got] == [h.tokens for h in expected]
    assert [h.score for h in got] == pytest.approx([h.score for h in expected], rel=1e-6)
    assert all(math.isfinite(h.score) for h in got)


# --- a prefix the vocabulary cannot spell (issue 71, class 1); a prefix cut to the model's length


@pytest.mark.parametrize("prefix", ["the dog X", "the 🐕 dog", "the 狗"])
def test_a_prefix_with_characters_outside_the_vocabulary_is_refused(
    untrained_checkpoint, source, tmp_path, capsys, prefix
):
    """Such a character became ' ⁇ ' in the output, which then no longer started with the prefix given."""
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    odd = next(c for c in prefix if c in "X🐕狗")
    with pytest.raises(ValueError, match=rf"prefixes\[1\]=.*{re.escape(repr(odd))} \(U\+{ord(odd):04X}\) not in"):
        translator.translate(SOURCE.splitlines(), prefixes=["the dog", prefix])
    prefixes = tmp_path / "prefix.en"
    prefixes.write_text(f"the dog\n{prefix}\n", encoding="utf-8")
    code, out, err = run_main(translate_main, capsys, untrained_checkpoint, "--input", source, "--prefix", prefixes)
    assert code == 2 and out == ""
    assert_one_line_refusal(err, "transformer-translate", rf"--prefix {re.escape(str(prefixes))} line 2: .*not in")


def test_a_prefix_cut_to_the_models_length_is_said(untrained_checkpoint, source, tmp_path, capsys):
    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    long_prefix = " ".join(["the dog"] * 600)
    with pytest.warns(UserWarning, match=r"1 prefix\(es\) longer than \d+ tokens were cut"):
        translator.encode_prefixes(["", long_prefix], 2)
    prefixes = tmp_path / "prefix.en"
    prefixes.write_text(f"\n{long_prefix}\n", encoding="utf-8")
    code, out, err = run_main(
        translate_main, capsys, untrained_checkpoint, "--input", source, "--prefix", prefixes, "--max-len-b", 2
    )
    assert code == 0 and len(out.splitlines()) == 2
    assert "1 prefix(es) longer than" in one_line(err)


# --- messages that said the wrong thing, results lost after the work (issue 71, minor)


def _read_only_file_system(monkeypatch):
    """Every new file fails as on a file system mounted read-only (root bypasses permissions, not that)."""
    import tempfile

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)


def test_an_output_on_a_read_only_file_system_is_said_so_before_translating(
    untrained_checkpoint, source, tmp_path, capsys, monkeypatch
):
    _read_only_file_system(monkeypatch)
    output = tmp_path / "out.en"
    code, out, err = run_main(translate_main, capsys, untrained_checkpoint, "--input", source, "--output", output)
    assert code == 2 and not output.exists()
    assert_one_line_refusal(
        err, "transformer-translate", r"--output .*out\.en: cannot be written \(read-only file system\)$"
    )


def test_evaluate_beside_a_checkpoint_on_a_read_only_file_system_refuses_before_translating(
    untrained_checkpoint, source, tmp_path, capsys, monkeypatch
):
    """It translated everything, then failed to write and printed no score."""
    (tmp_path / "ref.en").write_text("The dog sees the cat.\nThe woman gives the man the book.\n")
    _read_only_file_system(monkeypatch)

    def never(*args, **kwargs):
        raise AssertionError("translated before finding that the results cannot be written")

    monkeypatch.setattr(Translator, "translate", never)
    code, out, err = run_main(
        evaluate_main, capsys, untrained_checkpoint, "--src", source, "--ref", tmp_path / "ref.en"
    )
    assert code == 2 and out == ""
    assert_one_line_refusal(err, "transformer-evaluate", r"\.hyp: cannot be written \(read-only file system\); ")


@pytest.mark.parametrize(
    "directions, message",
    [
        ("en-de", r"--directions en-de: this model translates de -> en only; give --directions de-en"),
        ("de-en,de-en", r"--directions de-en,de-en: de-en is given twice; give each direction once"),
    ],
)
def test_evaluate_directions_a_bilingual_model_cannot_score_or_given_twice_are_refused(
    untrained_checkpoint, capsys, directions, message
):
    """--directions en-de was refused naming --src-lang, which was not given; a direction given twice was
    scored twice and counted twice in the mean."""
    code, out, err = run_main(evaluate_main, capsys, untrained_checkpoint, "--directions", directions)
    assert code == 2 and out == ""
    assert_one_line_refusal(err, "transformer-evaluate", message)
