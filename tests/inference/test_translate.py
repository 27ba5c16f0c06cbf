"""The transformer-translate CLI, the Translator API and make evaluate."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_refusal
from transformer import Translator
from transformer.data.sources import load_split_text
from transformer.inference.evaluate import EvaluationSet, Models, evaluate
from transformer.inference.request import DecodeRequest
from transformer.inference.scoring import score


def _cli(*args, stdin: bytes = b""):
    proc = subprocess.run(
        [sys.executable, "-m", "transformer.cli.translate", *map(str, args)],
        input=stdin,
        capture_output=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")


@pytest.mark.slow
def test_cli_keeps_one_line_per_input_line_and_empty_lines(trained_checkpoint, tmp_path):
    source = tmp_path / "in.de"
    source.write_text("Der Hund sieht die Katze.\n\n   \nDie alte Frau hat das Pferd gefunden.\n\n")
    code, out, err = _cli(trained_checkpoint, "--input", source, "--beam", "3")
    assert code == 0, err
    lines = out.split("\n")[:-1]
    assert len(lines) == 5
    assert lines[1] == lines[2] == lines[4] == ""
    assert lines[0].startswith("The ") and lines[3]
    code, _, err = _cli(trained_checkpoint, "--input", source, "--output", tmp_path / "out.en")
    assert code == 0 and (tmp_path / "out.en").read_text() == out


def test_cli_handles_long_lines_and_invalid_utf8(untrained_checkpoint):
    long_line = ("Der Hund sieht die Katze " * 400).encode()  # 10,000 characters
    code, out, err = _cli(untrained_checkpoint, "--beam", "1", stdin=b"Die Kuh.\n" + long_line + b"\nDie \xff Maus.\n")
    assert code == 0, err
    assert len(out.split("\n")[:-1]) == 3
    assert "truncated" in err and "not valid UTF-8" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beam", "0"], "--beam 0"),
        (["--beam", "2", "--nbest", "3"], "--nbest 3"),
    ],
)
def test_cli_refuses_bad_options(untrained_checkpoint, args, message):
    code, _, err = _cli(untrained_checkpoint, *args)
    assert code == 2 and message in assert_one_line_refusal(err, "transformer-translate")


def test_cli_bad_checkpoints_give_one_clear_line(tmp_path, untrained_checkpoint):
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(untrained_checkpoint.read_bytes()[:1000])
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    for path, message in (
        (tmp_path / "missing.pt", "no such checkpoint"),
        (truncated, "not a readable checkpoint"),
        (text, "not a checkpoint (text or another format"),
    ):
        code, out, err = _cli(path, stdin=b"Hallo\n")
        assert code == 2 and out == "" and message in assert_one_line_refusal(err, "transformer-translate")


def test_nbest_output_format(untrained_checkpoint):
    code, out, _ = _cli(untrained_checkpoint, "--beam", "4", "--nbest", "3", stdin=b"Die Kuh.\nDer Hund.\n")
    rows = [line.split("\t") for line in out.strip().split("\n")]
    assert code == 0 and len(rows) == 6
    assert [r[0] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    scores = [float(r[1]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.slow
def test_python_api_and_evaluate_agree_with_the_cli(trained_checkpoint, trained_run):
    # In fp32: a bf16 translation can depend on which sentences share its batch, and the CLI batches
    # a pipe's lines as they arrive, so only fp32 makes the three paths comparable line for line.
    translator = Translator.from_checkpoint(trained_checkpoint, device="auto")
    assert translator.translate(["", "Der Hund."], beam_size=5)[0] == ""
    result = evaluate(
        Models((trained_checkpoint,), precision="fp32"), EvaluationSet(split="test"), DecodeRequest(beam_size=5)
    )
    config = translator.config.data
    sources, references = load_split_text(config, "test")
    code, out, _ = _cli(
        trained_checkpoint, "--beam", "5", "--precision", "fp32", stdin=("\n".join(sources) + "\n").encode()
    )
    cli_bleu = score(out.split("\n")[:-1], references, config.tgt_lang)["bleu"]
    assert code == 0 and cli_bleu == pytest.approx(result["bleu"], abs=1e-9)
    assert result["bleu"] > 80
    greedy = evaluate(trained_checkpoint, EvaluationSet(split="test"), DecodeRequest(beam_size=1))
    assert greedy["bleu"] > 75 and abs(greedy["bleu"] - result["bleu"]) < 10  # a trained model, both ways
    with open(result["hypotheses_file"]) as handle:
        assert len(handle.readlines()) == len(sources)


# glibc's default threshold adapts to the program's history, which makes fault counts vary from run to
# run; the "mmap" mode pins it at its starting value (128 KB) so the comparison is deterministic.
FAULT_PROBE = """
import ctypes, resource, sys, torch
from transformer.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
else:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
for size in range(3):
    torch.ones(2**21)                                 # 8 MB, freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(50):
    torch.ones(2**21 + 1024 * step)                   # a little larger each time, like decoding batches
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_keep_freed_memory_stops_reallocations_from_page_faulting_again():
    def faults(mode):
        run = subprocess.run([sys.executable, "-c", FAULT_PROBE, mode], capture_output=True, text=True, check=True)
        return int(run.stdout)

    kept, mapped = faults("keep"), faults("mmap")
    assert kept * 5 < mapped, (kept, mapped)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_users_malloc_variable_wins_over_keep_freed_memory():
    # MALLOC_MMAP_THRESHOLD_ pins glibc's threshold at 128 KB: every 8 MB block is mapped and faulted in again,
    # which keep_freed_memory would have stopped had it not left the user's setting alone
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}

    def faults(extra):
        run = subprocess.run(
            [sys.executable, "-c", FAULT_PROBE, "keep"], capture_output=True, text=True, check=True, env=extra
        )
        return int(run.stdout)

    kept, as_set = faults(os.environ.copy()), faults(env)
    assert kept * 5 < as_set, (kept, as_set)


# Freed 1 MB tensors with a small live block after each: a heap that cannot shrink from its top, which is
# what tensors of ever-changing shapes leave behind in a long run.
FRAGMENT_PROBE = """
import os, torch
from transformer.runtime import hand_back_freed_memory, keep_freed_memory
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
keep_freed_memory()
freed, kept = [], []
for _ in range(200):
    freed.append(torch.ones(2**18))                   # 1 MB
    kept.append(torch.ones(16))
del freed
before = resident()
hand_back_freed_memory()
print(before - resident())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not Path("/proc/self/statm").exists(), reason="glibc")
def test_hand_back_freed_memory_returns_the_free_pages_inside_a_fragmented_heap():
    run = subprocess.run([sys.executable, "-c", FRAGMENT_PROBE], capture_output=True, text=True, check=True)
    assert int(run.stdout) > 100 * 2**20, run.stdout  # of the 200 MB freed; without the trim, none


KERNEL_CACHE_PROBE = """
import sys
from pathlib import Path
import transformer.train  # noqa: F401  everything the training CLI imports before it calls tune_cpu_process
from transformer.runtime import tune_cpu_process
if sys.argv[1] == "tuned":
    tune_cpu_process()
import torch
weight = torch.randn(16, 16, dtype=torch.bfloat16)
for rows in range(17, 1300):                          # 1,283 shapes, more than oneDNN's default 1,024
    torch.randn(rows, 16, dtype=torch.bfloat16) @ weight
torch.randn(17, 16, dtype=torch.bfloat16) @ weight    # the first shape again: still compiled?
"""


def test_tune_cpu_process_keeps_more_compiled_kernels_than_onednns_default():
    """Under ONEDNN_VERBOSE=all oneDNN says whether each kernel came from its cache; after more shapes than
    its default capacity the first one is compiled again unless the CLIs' tuning ran first."""
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")

    def last_creation(mode, **env):  # "create:cache_hit" or "create:cache_miss"
        run = subprocess.run(
            [sys.executable, "-c", KERNEL_CACHE_PROBE, mode],
            capture_output=True,
            text=True,
            check=True,
            env={**base, "ONEDNN_VERBOSE": "all", **env},
        )
        created = [line for line in (run.stdout + run.stderr).splitlines() if ",create:" in line]
        if not created:
            pytest.skip("this CPU's bf16 matmuls do not go through oneDNN")
        return created[-1].split(",")[3]

    base = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert last_creation("plain") == "create:cache_miss"
    assert last_creation("tuned") == "create:cache_hit"
    assert last_creation("tuned", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024") == "create:cache_miss"  # the user's value


def test_the_default_beam_is_the_checkpoints_decode_config(untrained_checkpoint, tmp_path):
    import torch

    state = torch.load(untrained_checkpoint, weights_only=True)
    state["config"]["decode"].update(name="greedy", beam_size=1, alpha=0.0)
    greedy_checkpoint = tmp_path / "greedy.pt"
    torch.save(state, greedy_checkpoint)
    text = b"Der Hund sieht die Katze.\nDie Frau gibt dem Mann das Buch.\n"
    code, default, _ = _cli(greedy_checkpoint, stdin=text)
    assert code == 0 and default == _cli(greedy_checkpoint, "--beam", "1", stdin=text)[1]
    code, _, err = _cli(greedy_checkpoint, "--nbest", "2", stdin=text)  # a beam of 1 has no second best
    assert code == 2 and "the checkpoint's beam size is 1; add --beam 2" in err
    assert _cli(untrained_checkpoint, "--nbest", "2", stdin=text)[0] == 0  # beam 5 there


def test_cuda_devices_by_number_are_understood():
    """cuda:1 is a device name the command takes: refused in one line only where this machine lacks that
    device, before the checkpoint is looked at; on a machine with two GPUs the missing checkpoint is the
    problem."""
    import torch

    code, out, err = _cli("missing.pt", "--device", "cuda:1", stdin=b"x\n")
    if not torch.cuda.is_available():
        problem = "--device cuda:1: CUDA is not available"
    elif torch.cuda.device_count() < 2:
        count = torch.cuda.device_count()
        problem = f"--device cuda:1: there are {count} CUDA device(s) (0 to {count - 1})"
    else:
        problem = "missing.pt: no such checkpoint file"
    assert (code, out, err) == (2, "", f"transformer-translate: error: {problem}\n")


def test_reference_scores_are_sums_of_per_token_log_probabilities(untrained_checkpoint, tmp_path):
    import torch

    from transformer.data.tokenizer import BOS_ID, EOS_ID

    translator = Translator.from_checkpoint(untrained_checkpoint, device="cpu", precision="fp32")
    sources, references = load_split_text(translator.config.data, "test")
    sources, references = sources[:30], references[:30]
    references[3] = ""  # an empty translation: EOS alone
    scores = translator.score(sources, references, batch_tokens=64)  # several length-sorted batches
    model, tokenizer = translator.model, translator.tokenizer
    for source, reference, value in zip(sources, references, scores):  # one sentence, one full forward
        src = torch.tensor([tokenizer.encode_src([source])[0] + [EOS_ID]])
        tgt = tokenizer.encode_tgt([reference])[0]
        with torch.no_grad():
            logits = model(src, torch.tensor([[BOS_ID] + tgt]))[0]  # (T, V)
        expected = torch.log_softmax(logits.double(), -1)[torch.arange(len(tgt) + 1), tgt + [EOS_ID]].sum()
        assert value == pytest.approx(expected.item(), abs=1e-3)
    translations = translator.translate(sources, beam_size=5)
    assert sum(translator.score(sources, translations)) > sum(scores)  # the model prefers its own output
    (tmp_path / "src").write_text("\n".join(sources) + "\n")
    (tmp_path / "ref").write_text("\n".join(references) + "\n")
    code, out, _ = _cli(
        untrained_checkpoint, "--input", tmp_path / "src", "--score-reference", tmp_path / "ref", "--precision", "fp32"
    )
    assert code == 0 and [float(x) for x in out.split()] == pytest.approx(scores, abs=1e-3)
    (tmp_path / "short").write_text("one line\n")
    code, _, err = _cli(untrained_checkpoint, "--input", tmp_path / "src", "--score-reference", tmp_path / "short")
    assert code == 2 and "1 lines for 30 input lines" in err


def test_cli_sampling_is_seeded(untrained_checkpoint):
    text = ("\n".join(["Der Hund sieht die Katze.", "Die Frau gibt dem Mann das Buch."] * 10) + "\n").encode()
    runs = [
        _cli(untrained_checkpoint, "--sampling", "topk:8", "--temperature", "1.5", "--seed", str(seed), stdin=text)
        for seed in (7, 7, 8)
    ]
    assert all(code == 0 for code, _, _ in runs)
    assert runs[0][1] == runs[1][1] != runs[2][1]
    assert len(runs[0][1].splitlines()) == 20 and len(set(runs[0][1].splitlines())) > 2  # samples vary
    for bad, message in (
        (["--sampling", "topx:3"], "--sampling topx:3: write topk:K"),
        (["--sampling", "topp:1.5"], "--sampling topp:1.5: write topk:K"),
        (["--sampling", "topk:4", "--beam", "4"], "leave out --beam and --nbest"),
        (["--sampling", "topk:4", "--temperature", "0"], "--temperature 0.0: must be"),
    ):
        code, _, err = _cli(untrained_checkpoint, *bad, stdin=b"Hallo\n")
        assert code == 2 and message in assert_one_line_refusal(err, "transformer-translate"), err


def test_a_pipe_receives_the_first_translations_before_the_input_ends(untrained_checkpoint, tmp_path):
    import queue
    import threading

    from transformer.checkpoint import load_checkpoint, model_from_checkpoint

    _, _, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    sources = load_split_text(config.data, "validation")[0][:40]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer.cli.translate",
            str(untrained_checkpoint),
            "--beam",
            "2",
            "--precision",
            "fp32",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(raw) for raw in iter(proc.stdout.readline, b"")], daemon=True).start()
    try:
        proc.stdin.write(("\n".join(sources[:3]) + "\n").encode())
        proc.stdin.flush()
        # The input is still open: the first three translations must come anyway.
        first = [lines.get(timeout=120).decode().rstrip("\n") for _ in range(3)]
        assert proc.poll() is None
        proc.stdin.write(("\n".join(sources[3:]) + "\n\n").encode())  # the rest, and an empty line
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
    finally:
        proc.kill()
    rest = []
    while not lines.empty():
        rest.append(lines.get().decode().rstrip("\n"))
    # Streamed in chunks, the output is what one batch of the whole file gives, line for line.
    source_file = tmp_path / "in.de"
    source_file.write_text("\n".join(sources) + "\n\n")
    code, whole, err = _cli(untrained_checkpoint, "--input", source_file, "--beam", "2", "--precision", "fp32")
    assert code == 0, err
    assert first + rest == whole.split("\n")[:-1] and len(first + rest) == 41 and rest[-1] == ""


def test_stream_chunks_take_what_has_arrived(tmp_path):
    import io

    from transformer.cli.streams import stream_chunks

    data = "\ufeffeins\r\nzwei\n".encode() + b"\xff drei\n" + b"vier"
    chunks = list(stream_chunks(io.BytesIO(data), max_lines=3))
    assert [line for lines, _ in chunks for line in lines] == ["eins", "zwei", "\ufffd drei", "vier"]
    assert all(len(lines) <= 3 for lines, _ in chunks) and sum(bad for _, bad in chunks) == 1
