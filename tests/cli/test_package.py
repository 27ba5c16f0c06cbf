"""The package as pip sees it: every third-party import declared in pyproject.toml, and a translating
install that needs no data stack (datasets, pyarrow, pandas: the [data] extra)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, one_line, write_untrained_checkpoint
from transformer.config import DataConfig
from transformer.data.sources import DataError, open_split

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DATA_STACK = ("datasets", "pyarrow", "pandas")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "hydra": "hydra-core", "mlflow": "mlflow-skinny"}
# imported through another package: tensorboard by torch.utils.tensorboard
IMPORTED_INDIRECTLY = {"tensorboard"}


def _third_party_imports(folder) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    local = {p.stem for p in folder.glob("*.py")} | {"transformer"}
    return {n for n in names - local if n not in sys.stdlib_module_names}


def _distribution(requirement: str) -> str:
    """`hydra-core>=1.3.2,<1.4` -> `hydra-core`; names normalized as pip does (huggingface_hub == huggingface-hub)."""
    name = requirement.split(";")[0]
    for mark in "<>=!~[ ":
        name = name.split(mark)[0]
    return name.strip().lower().replace("_", "-")


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = {
        extra: {_distribution(r) for r in requirements}
        for extra, requirements in project["optional-dependencies"].items()
    }
    return {_distribution(r) for r in project["dependencies"]} | IMPORTED_INDIRECTLY, extras


@pytest.mark.parametrize(
    "folder,allowed_extras",
    [("transformer", ("data", "export", "hf", "mlflow", "wandb")), ("scripts", ("export", "dev"))],
)
def test_every_third_party_import_is_declared(folder, allowed_extras):
    dependencies, extras = _declared()
    declared = dependencies.union(*(extras[e] for e in allowed_extras))
    imported = {DISTRIBUTIONS.get(n, n).lower().replace("_", "-") for n in _third_party_imports(ROOT / folder)}
    assert imported, "found no imports"
    assert imported <= declared, f"imported by {folder}/ but not declared: {sorted(imported - declared)}"


def test_the_data_stack_is_an_extra_that_make_install_includes():
    dependencies, extras = _declared()
    assert not dependencies & set(DATA_STACK)
    assert {"datasets", "pyarrow"} <= extras["data"]
    assert "transformer" in extras["dev"]  # `make install` is pip install -e '.[dev]'
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(r.replace(" ", "").startswith("transformer[") and "data" in r for r in dev)


def _loaded_data_stack(code: str) -> list[str]:
    """The data-stack modules loaded after running `code` (one blocked by WITHOUT_DATA_STACK is None: not loaded)."""
    probe = (
        f"{code}\nimport sys, json\nprint(json.dumps(sorted(name for name, module in sys.modules.items() "
        f"if name.split('.')[0] in {DATA_STACK!r} and module is not None)))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_commands_loads_no_data_stack():
    assert (
        _loaded_data_stack(
            "import transformer.cli.translate, transformer.cli.export, transformer.cli.evaluate, "
            "transformer.cli.prepare, transformer.train"
        )
        == []
    )


# Run with the data stack made unimportable, as in an install without the [data] extra.
WITHOUT_DATA_STACK = f"import sys\nfor name in {DATA_STACK!r}:\n    sys.modules[name] = None\n"


def test_translating_and_exporting_need_no_data_stack(tmp_path):
    checkpoint = write_untrained_checkpoint(tmp_path / "best.pt")
    source = tmp_path / "in.txt"
    source.write_text("Der Hund.\nDie Katze.\n")
    out = tmp_path / "exported"
    code = (
        WITHOUT_DATA_STACK
        + f"""
from transformer import Translator
from transformer.cli.export import main as export
from transformer.cli.translate import main as translate
assert len(Translator.from_checkpoint({str(checkpoint)!r}).translate(["Der Hund."], beam_size=2, max_len_b=5)) == 1
assert export([{str(checkpoint)!r}, {str(out)!r}, "--format", "safetensors"]) == 0
assert len(Translator.from_pretrained({str(out)!r}).translate(["Der Hund."], beam_size=1, max_len_b=5)) == 1
for model in ({str(checkpoint)!r}, {str(out)!r}):
    assert translate([model, "--input", {str(source)!r}, "--output", {str(tmp_path / "out.txt")!r},
                      "--max-len-b", "5"]) in (0, None)
"""
    )
    assert _loaded_data_stack(code) == []
    assert len((tmp_path / "out.txt").read_text().splitlines()) == 2


def test_preparing_a_plain_text_corpus_needs_no_data_stack(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, n in (("train", 300), ("validation", 20), ("test", 20)):
        (corpus / f"{split}.de").write_text("".join(f"Satz Nummer {i} hier.\n" for i in range(n)))
        (corpus / f"{split}.en").write_text("".join(f"Sentence number {i} here.\n" for i in range(n)))
    code = (
        WITHOUT_DATA_STACK
        + f"""
from transformer.cli.prepare import main
main(["data=custom", "data.path={corpus}", "data.vocab_size=60", "data.cache_dir={tmp_path / "cache"}"])
"""
    )
    assert _loaded_data_stack(code) == []
    assert (tmp_path / "cache" / "corpus").is_dir()


@pytest.mark.parametrize("source", ["hub", "parquet", "jsonl"])
def test_a_source_that_needs_the_data_extra_says_so_in_one_line(source, tmp_path, monkeypatch):
    for name in DATA_STACK:
        monkeypatch.setitem(sys.modules, name, None)  # `import datasets` raises ImportError
    if source == "hub":
        cfg, where = DataConfig(name="wmt", hub_id="wmt/wmt14"), "data.hub_id=wmt/wmt14"
    else:
        (tmp_path / f"train.{source}").write_text("")
        cfg, where = DataConfig(name="mine", path=str(tmp_path)), str(tmp_path / f"train.{source}")
    monkeypatch.chdir(ROOT)  # in the checkout: its extra
    with pytest.raises(DataError) as caught:
        open_split(cfg, "train")
    assert str(caught.value) == (
        f"{where}: needs HuggingFace datasets, which reads it: pip install -e '.[data]' (or make install: every extra)"
    )


def test_install_hints_name_a_command_that_works_from_where_the_user_is(tmp_path, monkeypatch):
    """`pip install 'transformer[data]'` asks the index for a project named transformer: from a checkout
    the hint names the checkout's extra, from an installed wheel the packages themselves."""
    from importlib.metadata import PackageNotFoundError

    import transformer.install as install

    monkeypatch.chdir(ROOT)
    assert install.install_hint("data") == "pip install -e '.[data]' (or make install: every extra)"
    monkeypatch.chdir(tmp_path)
    assert install.install_hint("export") == f"pip install -e '{ROOT}[export]' (or make install in {ROOT}: every extra)"
    assert (
        install.upgrade_hint()
        == f"update the checkout {ROOT} (git pull) and reinstall it (pip install -e . or make install)"
    )
    # An installed wheel: no pyproject.toml above the package; the packages its metadata lists for the extra
    wheel = tmp_path / "site-packages" / "transformer"
    wheel.mkdir(parents=True)
    monkeypatch.setattr(install, "PACKAGE_DIR", wheel)
    listed = [
        "torch>=2.11",
        'datasets>=3.0; extra == "data"',
        "pyarrow>=15 ; extra == 'data'",
        'wandb; extra == "wandb"',
    ]
    monkeypatch.setattr(install, "requires", lambda name: listed)
    assert install.install_hint("data") == "pip install datasets pyarrow"
    assert install.install_hint("wandb") == "pip install wandb"

    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(install, "requires", not_installed)  # metadata gone: the names kept in install.EXTRAS
    assert install.install_hint("mlflow") == "pip install mlflow-skinny sqlalchemy alembic"
    assert install.upgrade_hint() == "install a newer release"


def test_the_install_hints_know_every_extra_of_pyproject():
    from transformer.install import EXTRAS

    _, extras = _declared()
    assert {extra: set(names) for extra, names in EXTRAS.items()} == {
        extra: names for extra, names in extras.items() if extra != "dev"
    }


def test_importing_the_model_loads_neither_the_tokenizer_nor_the_corpus_readers():
    code = (
        "import sys, transformer.model; "
        "print(sorted(m for m in sys.modules if m in ('transformer.data.tokenizer', 'transformer.data.sources', "
        "'transformer.data.corpus', 'sentencepiece')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize(
    "module",
    [
        "inference.translator",
        "cli.translate",
        "inference.search",
        "checkpoint",
        "inference.pretrained",
        "cli.export",
        "data.batching",
    ],
)
def test_the_inference_side_does_not_load_the_corpus_readers(module):
    """Only what reads corpora (data, corpus, train, evaluate) imports transformer.data.sources; the rest raise
    DataError from its leaf module, transformer.errors."""
    code = (
        f"import sys, transformer.{module}; "
        "print(sorted(m for m in sys.modules if m in ('transformer.data.sources', 'transformer.data.corpus', 'hydra')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_data_error_has_one_home():
    from transformer import errors
    from transformer.data import sources as data

    assert data.DataError is errors.DataError


# Each command answers --help and refuses a bad argument (in one line) before it loads torch (about 2 s):
# (module, arguments, exit code, words of the answer).
ANSWERED_WITHOUT_TORCH = [
    ("transformer.cli.translate", ["--help"], 0, "usage: transformer-translate"),
    ("transformer.cli.translate", ["best.pt", "--beam", "0"], 2, "--beam 0: must be a whole number >= 1"),
    ("transformer.cli.translate", ["best.pt", "--device", "tpu"], 2, "--device tpu: must be auto, cpu, cuda or cuda:N"),
    ("transformer.cli.translate", ["best.pt", "--sampling", "top3"], 2, "--sampling top3: write topk:K"),
    ("transformer.cli.translate", ["best.pt", "--bogus"], 2, "unrecognized arguments: --bogus"),
    ("transformer.cli.evaluate", ["--help"], 0, "usage: transformer-evaluate"),
    ("transformer.cli.evaluate", ["best.pt", "--alpha", "nan"], 2, "--alpha nan: must be a finite number"),
    ("transformer.cli.evaluate", ["a.pt", "b.pt", "--weights", "1"], 2, "--weights 1: give 2 comma-separated numbers"),
    ("transformer.cli.export", ["--help"], 0, "usage: transformer-export"),
    (
        "transformer.cli.export",
        ["best.pt", "out", "--format", "safetensors", "--quantization", "int8"],
        2,
        "--quantization applies to --format ctranslate2 only",
    ),
    ("transformer.cli.average", ["--help"], 0, "usage: transformer-average"),
    ("transformer.cli.average", ["best.pt"], 2, "the following arguments are required: --output/-o"),
    ("transformer.cli.prepare", ["--help"], 0, "transformer-prepare: train the tokenizer"),
    ("transformer.cli.prepare", ["--bogus"], 2, "transformer-prepare: unrecognized arguments: --bogus"),
    ("transformer.cli.train", ["--help"], 0, "transformer-train: train a Transformer"),
    ("transformer.cli.train", ["--help", "model.d_model=64"], 0, "-> 64"),
    (
        "transformer.cli.train",
        ["model", "small"],
        2,
        "error: transformer-train: 'model' is not an override: write KEY=VALUE or GROUP=OPTION (e.g. model=NAME)",
    ),
    ("transformer.cli.prepare", ["data=toy", "trainer.lr"], 2, "'trainer.lr' is not an override"),
]


@pytest.mark.parametrize("module,arguments,exit_code,answer", ANSWERED_WITHOUT_TORCH)
def test_a_command_answers_help_and_bad_arguments_without_loading_torch(module, arguments, exit_code, answer, tmp_path):
    probe = f"""
import json, sys
sys.argv = ["command", *{arguments!r}]
from {module} import main
try:
    code = main()
except SystemExit as exit:
    code = exit.code
print(json.dumps([code or 0, "torch" in sys.modules]))
"""
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    code, loaded_torch = json.loads(result.stdout.splitlines()[-1])
    assert (code, loaded_torch) == (exit_code, False), result.stderr
    assert answer in (result.stdout if exit_code == 0 else result.stderr)
    if exit_code:  # a refusal is one line, without argparse's usage block
        one_line(result.stderr)


def test_the_upload_command_the_docs_give_is_the_installed_huggingface_hubs():
    """huggingface_hub replaced `huggingface-cli` with `hf` (the tested release has no other): the docs'
    commands must be ones it has."""
    import shutil
    from pathlib import Path

    commands = [
        line.split("#")[0].split()
        for line in (ROOT / "docs" / "translating.md").read_text(encoding="utf-8").splitlines()
        if line.startswith(("hf ", "huggingface-cli "))
    ]
    assert ["hf", "upload", "you/de-en-multi30k", "my-model/", "."] in commands, commands
    assert all(words[0] == "hf" for words in commands), commands
    hf = Path(sys.executable).with_name("hf")
    hf = str(hf) if hf.exists() else shutil.which("hf")
    if hf is None:
        pytest.skip("huggingface_hub's hf command is not installed here")
    for words in commands:
        done = subprocess.run(
            [hf, *words[1 : 3 if words[1] == "auth" else 2], "--help"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    assert "REPO_ID" in subprocess.run([hf, "upload", "--help"], capture_output=True, text=True).stdout
