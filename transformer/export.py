"""Models that leave the repository: `transformer-export CKPT --format safetensors|ctranslate2 OUT`.

`--format safetensors` writes a shareable directory with no pickle in it, which
`Translator.from_pretrained` loads (from disk, or from the HuggingFace Hub after `huggingface-cli upload`).
It is this package's format, not a `transformers` model (our architecture is no `transformers` model
class): `--format hf`, its old name, still works and says so once.

    model.safetensors    the weights (a tied matrix stored once)
    config.json          the training config (model shape, languages, decoding defaults) and the format version
    spm.model            the joint SentencePiece model, or src.spm.model and tgt.spm.model
    README.md            the model card: languages, training data, shape, validation scores, how to load it
    export-manifest.json the names of the files the export wrote (both formats): `--force` replaces a
                         directory only when it holds these files and nothing else; and their SHA-256
                         digests (`sha256sum` prints the same), against which `load_pretrained` checks the
                         weights and the SentencePiece models it reads (config.json and README.md are
                         left free to edit)

Every exported file gets the permissions of a file created normally under the umask (safetensors writes
through an owner-only temporary file).

`--format ctranslate2` writes a CTranslate2 model directory (through `ctranslate2.specs`) with the
SentencePiece model(s) beside it. CTranslate2 (`pip install 'transformer[export]'`) is imported
only here. CTranslate2 takes SentencePiece pieces as input: the exported model adds the source EOS
itself, as our encoder expects.

torch comes with the functions that need it (imported where they run), so that the command answers
--help and refuses bad arguments at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.config import Config, ConfigError
from transformer.errors import (
    CheckpointError,
    import_torch_holding_interrupts,
    next_interrupt_ends_at_once,
    os_error_in,
)
from transformer.tokenizer import Tokenizer
from transformer.translate import CommandLineParser

if TYPE_CHECKING:
    from transformer.model import Transformer

FORMAT_NAME = "transformer-nmt"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "export-manifest.json"
CARD_FILE = "README.md"
FORMATS = ("safetensors", "ctranslate2")
DEPRECATED_FORMATS = {"hf": "safetensors"}  # --format hf: the safetensors directory's first name
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """File name -> SentencePiece model bytes, as both export formats lay them out."""
    if tokenizer.joint:
        return {"spm.model": tokenizer.src_model_bytes}
    return {"src.spm.model": tokenizer.src_model_bytes, "tgt.spm.model": tokenizer.tgt_model_bytes}


def check_output_directory(out: Path, overwrite: bool) -> None:
    """Refuse an existing `out` unless `overwrite` (--force) and it holds a previous export's files and
    nothing else, and is not the directory this process runs in (or one above it)."""
    if not out.exists():
        return
    # What --force could not replace is said as such first: "pass --force" would only be refused next.
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; choose a new directory for the export")
    exported = _exported_files(out)
    unexpected = sorted(
        entry.name
        for entry in out.iterdir()
        if exported is None or entry.name not in exported or (entry.is_dir() and not entry.is_symlink())
    )
    if unexpected and exported is None:
        raise FileExistsError(
            f"{out}: is not an exported model (it holds {_listing(unexpected)}); --force replaces "
            "only a previous export and nothing else: choose a new directory"
        )
    if unexpected:
        raise FileExistsError(
            f"{out}: holds files the previous export did not write ({_listing(unexpected)}); "
            "--force replaces only a previous export and nothing else: move them out or choose a "
            "new directory"
        )
    here = Path.cwd().resolve()
    if out == here or out in here.parents:
        raise FileExistsError(
            f"{out}: is the current directory or holds it; run transformer-export from outside "
            "it to replace it, or choose a new directory"
        )
    if not overwrite:
        raise FileExistsError(f"{out}: already exists (an earlier export); pass --force to replace it")


def _exported_files(directory: Path) -> set[str] | None:
    """The names of the files a previous export wrote into `directory`: those its manifest lists (an hf
    export from before manifests: those its config.json names), or None when it holds no export."""
    try:
        files = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
        return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, not JSON, not a manifest
        return None
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    layouts = (["spm.model"], ["src.spm.model", "tgt.spm.model"])
    if isinstance(meta, dict) and meta.get("format") == FORMAT_NAME and meta.get("tokenizer") in layouts:
        return {CONFIG_FILE, WEIGHTS_FILE, *meta["tokenizer"]}
    return None


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes in hex, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):  # hashlib.file_digest: Python 3.11 on
            digest.update(block)
    return digest.hexdigest()


def _recorded_digests(folder: Path) -> dict:
    """The SHA-256 of each file as the export's manifest recorded it; {} for an export without digests
    (written before they were recorded) or without a readable manifest: the manifest is the export's
    record, not a file loading needs."""
    try:
        digests = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8")).get("sha256", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return digests if isinstance(digests, dict) else {}


def _check_recorded_digest(folder: Path, name: str, digests: dict) -> None:
    """CheckpointError when `digests` (`_recorded_digests`) has a SHA-256 for `name` and the file's bytes
    no longer have it (a disk, copy or transfer error)."""
    recorded = digests.get(name)
    if not isinstance(recorded, str) or not (folder / name).is_file():
        return  # a missing file is reported by whoever reads it
    if file_sha256(folder / name) != recorded.lower():
        raise CheckpointError(
            f"{folder / name}: damaged: its bytes no longer match the SHA-256 the export recorded "
            f"in {MANIFEST_FILE} (a disk, copy or transfer error); copy or download the exported "
            "directory again, or export it again from its checkpoint"
        )


def _listing(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _write_model_directory(out: str | Path, overwrite: bool, tokenizer: Tokenizer, build, export_format: str) -> Path:
    """`build(directory)` creates a model directory (a path that does not exist yet, in a staging directory
    beside `out`); the SentencePiece model(s) and the manifest are added and the whole is moved into place.
    A failed export leaves no half-written model behind and a previous export as it was; `--force`
    replaces only a previous export (check_output_directory)."""
    out = Path(out).resolve()
    check_output_directory(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{out}: cannot write the export: a part of {out.parent} is a file, not a directory"
        ) from None
    except OSError as error:
        raise CheckpointError(f"{out}: cannot write the export: {_failure_reason(error)}") from None
    try:
        built = staging / "model"  # created by `build` with the usual permissions
        try:
            build(built)
            for name, data in tokenizer_files(tokenizer).items():
                (built / name).write_bytes(data)
            files = sorted([entry.name for entry in built.iterdir()] + [MANIFEST_FILE])
            digests = {entry.name: file_sha256(entry) for entry in sorted(built.iterdir()) if entry.is_file()}
            manifest = built / MANIFEST_FILE
            manifest.write_text(
                json.dumps({"format": export_format, "files": files, "sha256": digests}, indent=2) + "\n",
                encoding="utf-8",
            )
            for entry in built.iterdir():  # as the manifest: the umask's, not a writer's own
                shutil.copymode(manifest, entry)
        except (OSError, RuntimeError) as error:  # a full disk; CTranslate2 and safetensors wrap theirs
            raise CheckpointError(f"{out}: cannot write the export: {_failure_reason(error)}") from None
        previous = staging / "previous"
        try:
            if out.exists():
                check_output_directory(out, overwrite)  # again: nothing was added while the model was built
                os.replace(out, previous)
            os.replace(built, out)
        except BaseException:
            if previous.exists() and not out.exists():
                os.replace(previous, out)
            raise
    finally:
        shutil.rmtree(staging)
    return out


def _failure_reason(error: BaseException) -> str:
    """What made a write fail, in words: the OSError in its chain (a full disk is ENOSPC), the error
    code in a safetensors message, else the error's own first line."""
    cause = os_error_in(error)
    if cause is not None:
        return os.strerror(cause.errno)
    text = str(error).strip()
    code = re.search(r"\bOs \{ code: (\d+)", text)  # safetensors: IoError(Os { code: 28, ... })
    if code:
        return os.strerror(int(code.group(1)))
    return text.splitlines()[0][:200] if text else type(error).__name__


# ----- the shareable safetensors directory ---------------------------------------------------------


def save_pretrained(
    model: Transformer,
    tokenizer: Tokenizer,
    config: Config,
    out: str | Path,
    overwrite: bool = False,
    trained: dict | None = None,
) -> Path:
    """The safetensors directory (the module's docstring). `trained`: the checkpoint's `step` and
    `metrics`, for the model card."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    from transformer.translator import is_int8

    if is_int8(model):
        raise ValueError(
            "save_pretrained takes the float model, not an int8 one: save the model of "
            "Translator.from_checkpoint(path) without quantize=, and quantize when loading it "
            '(Translator.from_pretrained(directory, quantize="int8"))'
        )
    _refuse_non_finite(model, "the model")
    card = model_card(model, tokenizer, config, Path(out).resolve().name, trained or {})

    def build(directory: Path) -> None:
        directory.mkdir()
        try:
            save_model(model, str(directory / WEIGHTS_FILE), metadata={"format": FORMAT_NAME})
        except SafetensorError as error:  # its writer's I/O errors (a full disk) come as these
            raise RuntimeError(str(error)) from None
        canonical_safetensors_header(directory / WEIGHTS_FILE)
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tokenizer": sorted(tokenizer_files(tokenizer)),
            "config": config.to_dict(),
        }
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        (directory / CARD_FILE).write_text(card, encoding="utf-8")

    return _write_model_directory(out, overwrite, tokenizer, build, "safetensors")


def canonical_safetensors_header(path: Path) -> None:
    """Rewrite the JSON header of a safetensors file with its keys sorted, in place. save_model records
    the tied weights it left out in the header's metadata, a hash map whose order changes from one
    process to the next: without this, two exports of one checkpoint differ in their bytes and digests.
    The header keeps its length (the same compact JSON, reordered; spaces pad, as the format allows), so
    the tensor data does not move."""
    with open(path, "r+b") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
        ordered = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(ordered) > length:  # not the compact JSON this was written with: leave it
            print(
                f"warning: {path}: its header is not the compact JSON expected of safetensors' writer; it is "
                "left as written, so two exports of this checkpoint may differ in their bytes",
                file=sys.stderr,
            )
            return
        file.seek(8)
        file.write(ordered.ljust(length, b" "))


def model_card(model: Transformer, tokenizer: Tokenizer, config: Config, name: str, trained: dict) -> str:
    """README.md of the safetensors directory `name`: HuggingFace Hub metadata (YAML front matter), then
    the languages, the training data, the model's shape, the checkpoint's validation scores and how to
    load it. `trained`: the checkpoint's `step` and `metrics` (either may be missing)."""
    data, shape = config.data, config.model
    src, tgt = data.src_lang, data.tgt_lang
    directions, targets = data.directions(), tokenizer.target_languages
    languages = data.languages() if targets or data.corpora else [src, tgt]
    front = [
        "---",
        f"library_name: {FORMAT_NAME}",
        "language:",
        *(f"- {json.dumps(x)}" for x in languages),
        "tags:",
        "- translation",
        "pipeline_tag: translation",
        "license: other",
    ]
    title = (
        f"multilingual translation ({', '.join(f'{a} → {b}' for a, b in directions)})"
        if targets
        else f"{src} → {tgt} translation"
    )
    said = (
        (
            f"Directions trained: {', '.join(f'`{a}` → `{b}`' for a, b in directions)}. Choose the target "
            f"language ({', '.join(f'`{x}`' for x in targets)}) with `tgt_lang=` or `--tgt-lang`: its tag "
            f"(`<2{targets[0]}>`, ...) starts every source sentence."
        )
        if targets
        else f"Source `{src}`, target `{tgt}`."
    )
    choose = f', tgt_lang="{tgt}"' if targets else ""
    if data.hub_id:
        front += ["datasets:", f"- {json.dumps(data.hub_id)}"]
    parameters = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
    vocabulary = (
        f"one joint SentencePiece {data.tokenizer_type} vocabulary of {tokenizer.src_vocab_size} pieces"
        if tokenizer.joint
        else f"SentencePiece {data.tokenizer_type} vocabularies of "
        f"{tokenizer.src_vocab_size} ({src}) and {tokenizer.tgt_vocab_size} ({tgt}) pieces"
    )
    lines = [
        *front,
        "---",
        "",
        f"# {name}: {title}",
        "",
        f"A Transformer encoder-decoder (Vaswani et al., 2017) trained with `{FORMAT_NAME}` (the Python "
        "package `transformer`). This directory is that package's safetensors format: weights "
        f"(`{WEIGHTS_FILE}`), training config (`{CONFIG_FILE}`) and SentencePiece model(s).",
        "",
        "## Languages",
        "",
        said,
        "",
        "## Training data",
        "",
        _training_data(data),
        "",
        "## Model",
        "",
        f"- {parameters:,} parameters{' (embeddings tied)' if shape.tie_embeddings else ''}",
        f"- {shape.encoder_layers} encoder and {shape.decoder_layers} decoder layers, d_model {shape.d_model}, "
        f"{shape.n_heads} attention heads, feed-forward {shape.d_ff}, "
        f"{'pre' if shape.pre_norm else 'post'}-norm, at most {shape.max_positions} positions",
        f"- {vocabulary}",
        "",
        "## Evaluation",
        "",
        "\n\n".join(_evaluation(config, trained)),
        "",
        "## How to load it",
        "",
        "```python",
        "from transformer import Translator",
        "",
        f'translator = Translator.from_pretrained("{name}")    # this directory, or its Hub id owner/name',
        f'print(translator.translate(["..."]{choose}))',
        "```",
        "",
        "From the command line, one translation per input line:",
        "",
        "```sh",
        f"transformer-translate {name}{' --tgt-lang ' + tgt if targets else ''} < input.{src} > output.{tgt}",
        "```",
        "",
        "HuggingFace `transformers` cannot load this directory: the architecture is not a `transformers` "
        f"model class; load it with the `{FORMAT_NAME}` package as above.",
        "",
        "## License",
        "",
        "The terms of the training data apply to the model; set `license` above before publishing it.",
        "",
    ]
    return "\n".join(lines)


def _training_data(data) -> str:
    """The card's training data: the corpus and its splits, or the corpora of a mixture."""
    if not data.corpora:
        return (
            f"{_data_source(data)} (data preset `{data.name}`); splits: train `{data.split_name(data.train_split)}`, "
            f"validation `{data.split_name(data.valid_split)}`, test `{data.split_name(data.test_split)}`. "
            f"Training pairs longer than {data.max_len} tokens on either side were left out."
        )
    corpora = "; ".join(
        f"`{corpus.label(data)}`: {'`' + corpus.path + '`' if corpus.path else 'hub `' + str(corpus.hub_id) + '`'}, "
        f"{corpus.src_lang or data.src_lang} → {corpus.tgt_lang or data.tgt_lang}, weight {corpus.weight:g}"
        for corpus in data.corpora
    )
    source = _data_source(data)
    return (
        f"{len(data.corpora)} corpora mixed in each epoch by (weight × pairs)^(1/{data.temperature:g}) (data "
        f"preset `{data.name}`): {corpora}. Validation and test: {source[0].lower()}{source[1:]}. Training "
        f"pairs longer than {data.max_len} tokens on either side were left out."
    )


def _data_source(data) -> str:
    if data.path:
        return f"Local files in `{data.path}`"
    if data.hub_id:
        which = f", configuration `{data.hub_config}`" if data.hub_config else ""
        return f"The HuggingFace Hub dataset [`{data.hub_id}`](https://huggingface.co/datasets/{data.hub_id}){which}"
    return f"The generated toy corpus of `transformer/toy.py`, {data.embedded_pairs:,} training pairs"


def _evaluation(config: Config, trained: dict) -> list[str]:
    """The card's scores: those the checkpoint records, said for what they are."""
    metrics = trained.get("metrics") if isinstance(trained.get("metrics"), dict) else {}
    history = [v for v in metrics.get("val_history") or [] if isinstance(v, dict) and "bleu" in v]
    step = trained.get("step")
    lines = []
    if history:
        last = history[-1]
        tc = config.trainer
        sample = f"its first {tc.val_max_sentences} sentences" if tc.val_max_sentences else "all of it"
        lines.append(
            f"On the validation split (`{config.data.split_name(config.data.valid_split)}`, {sample}, "
            f"beam {tc.val_beam_size}), at step {last.get('step')}: BLEU {last['bleu']:.2f}, "
            f"chrF {last.get('chrf', float('nan')):.2f} (sacreBLEU, hypotheses and references in NFC)."
        )
        if step is not None and step != last.get("step"):
            lines.append(f"The exported weights are those of step {step}.")
    for key, label in (("bleu_signature", "BLEU signature"), ("chrf_signature", "chrF signature")):
        if metrics.get(key):
            lines.append(f"{label}: `{metrics[key]}`")
    if "test_bleu" in metrics:
        lines.append(f"Test split: BLEU {metrics['test_bleu']:.2f}, chrF {metrics.get('test_chrf', float('nan')):.2f}.")
    if "averaged_from" in metrics:
        lines.append(
            f"The weights are the average of {len(metrics['averaged_from'])} checkpoints; the scores "
            "above are those the last of them recorded."
        )
    return lines or ["The checkpoint records no validation scores (`transformer-evaluate` scores a checkpoint)."]


def load_pretrained(path: str | Path) -> tuple[Transformer, Tokenizer, Config]:
    """A directory written by `save_pretrained`, or a HuggingFace Hub id (downloaded and cached by
    huggingface_hub) -> (model, tokenizer, config). CheckpointError names what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    folder = Path(path)
    if folder.is_file():
        raise CheckpointError(
            f"{folder}: a file, not an exported directory; a .pt checkpoint loads with "
            "Translator.from_checkpoint (Translator.load takes either)"
        )
    if not folder.is_dir():
        folder = _download(str(path))
    config_path = folder / CONFIG_FILE
    try:
        meta = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        found = sorted(folder.glob("*.pt")) + sorted(folder.glob("checkpoints/*.pt"))
        hint = f"; did you mean {next((p for p in found if p.name == 'best.pt'), found[0])}?" if found else ""
        raise CheckpointError(
            f"{folder}: is a directory, not a checkpoint file, and holds no {CONFIG_FILE} of "
            f"an exported model (transformer-export --format safetensors){hint}"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error})") from None
    except OSError as error:  # a directory of that name, no permission to read it
        raise CheckpointError(f"{config_path}: {error.strerror}") from None
    if (folder / "model.bin").is_file() and not (folder / WEIGHTS_FILE).exists():
        raise CheckpointError(
            f"{folder}: a CTranslate2 model (transformer-export --format ctranslate2), which "
            "CTranslate2 translates (ctranslate2.Translator); transformer-translate takes the .pt "
            "checkpoint it was exported from or a --format safetensors directory"
        )
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = f"format {meta['format']!r}" if isinstance(meta, dict) and "format" in meta else 'no "format" key'
        raise CheckpointError(
            f"{config_path}: not a {FORMAT_NAME} model ({found}; another tool's model?); "
            "transformer-translate takes a .pt checkpoint or a transformer-export --format "
            "safetensors directory"
        )
    if type(meta.get("format_version", 0)) is not int or meta.get("format_version", 0) < 0:
        raise CheckpointError(
            f"{config_path}: format_version {meta['format_version']!r} is not a whole number >= 0; the file is damaged"
        )
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{config_path}: format version {meta['format_version']} is newer than this "
            f"package reads ({FORMAT_VERSION}); upgrade this package"
        )
    try:
        config = Config.from_dict(meta["config"], saved=True)
    except (ConfigError, KeyError, TypeError) as error:
        raise CheckpointError(f"{config_path}: its config is invalid: {error}") from None
    except AttributeError:  # "config": "x", [1] or null
        raise CheckpointError(
            f'{config_path}: its "config" is not a mapping of settings; the file is damaged'
        ) from None
    names = meta.get("tokenizer") or []
    if names not in (["spm.model"], ["src.spm.model", "tgt.spm.model"]):
        raise CheckpointError(
            f'{config_path}: unknown tokenizer files {names!r} (an export lists ["spm.model"] '
            'or ["src.spm.model", "tgt.spm.model"]); the file is damaged'
        )
    digests = _recorded_digests(folder)
    for name in names:
        _check_recorded_digest(folder, name, digests)
    try:
        if names == ["spm.model"]:
            tokenizer = Tokenizer((folder / "spm.model").read_bytes())
        else:
            tokenizer = Tokenizer((folder / "src.spm.model").read_bytes(), (folder / "tgt.spm.model").read_bytes())
    except OSError as error:
        raise CheckpointError(f"{folder}: {error.strerror}: {error.filename}") from None
    except RuntimeError as error:  # sentencepiece: not a model (e.g. a git-lfs pointer cloned without lfs)
        raise CheckpointError(
            f"{folder}: {', '.join(names)}: not a SentencePiece model ({str(error).splitlines()[0]}); "
            "if the directory was cloned with git, fetch its LFS files (git lfs pull)"
        ) from None
    from transformer.model import build_model

    model = build_model(
        config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint, initialize=False
    )  # every weight is loaded next (missing ones are refused)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS_FILE}")
    _check_recorded_digest(folder, WEIGHTS_FILE, digests)
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, RuntimeError) as error:
        raise CheckpointError(
            f"{weights}: weights do not fit the model of {CONFIG_FILE}: {str(error).splitlines()[0]}"
        ) from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: weights do not fit the model of {CONFIG_FILE}: missing "
            f"{', '.join(sorted(missing)[:3]) or 'none'}; unexpected "
            f"{', '.join(sorted(unexpected)[:3]) or 'none'}"
        )
    _refuse_non_finite(model, weights)
    return model, tokenizer, config


def _refuse_non_finite(model: Transformer, where: str | Path) -> None:
    from transformer.checkpoint import non_finite_tensors

    bad = non_finite_tensors(model.state_dict())
    if bad:
        raise CheckpointError(
            f"{where}: weight {bad[0]} holds NaN or infinite values (the run diverged); export a "
            "checkpoint from before it"
        )


def looks_like_hub_id(path: str | Path) -> bool:
    """`owner/name` with nothing of that name on disk: a HuggingFace Hub id rather than a local path."""
    text = str(path)
    return (
        text.count("/") == 1
        and not text.startswith((".", "/"))
        and not Path(text).exists()
        and Path(text).suffix != ".pt"
    )


def _download(repo_id: str) -> Path:
    if not looks_like_hub_id(repo_id):
        raise CheckpointError(f"{repo_id}: no such directory (a HuggingFace Hub id looks like owner/name)")
    from transformer.hub import cache_only_without_network

    offline = cache_only_without_network()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as error:  # offline, unknown repository, no access: one line either way
        reason = offline or f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise CheckpointError(
            f"{repo_id}: not a local directory, and the HuggingFace Hub did not provide it ({reason})"
        ) from None


# ----- CTranslate2 ---------------------------------------------------------------------------------


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """Our architecture as a `ctranslate2.specs.TransformerSpec`, weights set (float32, on the CPU)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.n_heads,
        pre_norm=cfg.pre_norm,
        activation=common_spec.Activation.RELU,
    )
    spec.config.layer_norm_epsilon = model.encoder_layers[0].sub_attn.norm.eps
    spec.config.add_source_eos = True  # our encoder reads "pieces </s>"
    weight = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}

    def linear(target, name):
        target.weight = weight[f"{name}.weight"]
        if f"{name}.bias" in weight:
            target.bias = weight[f"{name}.bias"]

    def norm(target, name):
        target.gamma, target.beta = weight[f"{name}.weight"], weight[f"{name}.bias"]

    table = model.positions.table.float().cpu()  # (max_positions, D)
    for side in (spec.encoder, spec.decoder):
        side.scale_embeddings = True  # x * sqrt(D) + PE
        side.position_encodings.encodings = table
    spec.encoder.embeddings[0].weight = weight["src_embed.weight"]
    spec.decoder.embeddings.weight = weight["tgt_embed.weight"]
    linear(spec.decoder.projection, "output")
    if cfg.pre_norm:
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{scope}.self_attn.qkv_proj")  # (3D, D): Q, K, V rows
        linear(layer.self_attention.linear[1], f"{scope}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{scope}.sub_attn.norm")
        linear(layer.ffn.linear_0, f"{scope}.feed_forward.up")
        linear(layer.ffn.linear_1, f"{scope}.feed_forward.down")
        norm(layer.ffn.layer_norm, f"{scope}.sub_ff.norm")
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{scope}.self_attn.qkv_proj")
        linear(layer.self_attention.linear[1], f"{scope}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{scope}.sub_self.norm")
        linear(layer.attention.linear[0], f"{scope}.cross_attn.q_proj")
        linear(layer.attention.linear[1], f"{scope}.cross_attn.kv_proj")  # (2D, D): K, V rows
        linear(layer.attention.linear[2], f"{scope}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{scope}.sub_cross.norm")
        linear(layer.ffn.linear_0, f"{scope}.feed_forward.up")
        linear(layer.ffn.linear_1, f"{scope}.feed_forward.down")
        norm(layer.ffn.layer_norm, f"{scope}.sub_ff.norm")
    pieces = [tokenizer.src.id_to_piece(i) for i in range(tokenizer.src_vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary([tokenizer.tgt.id_to_piece(i) for i in range(tokenizer.tgt_vocab_size)])
    return spec


def export_ctranslate2(
    model: Transformer, tokenizer: Tokenizer, out: str | Path, quantization: str | None = None, overwrite: bool = False
) -> Path:
    try:
        from ctranslate2.converters.converter import Converter
    except ImportError:
        raise CheckpointError(
            "--format ctranslate2 needs CTranslate2: pip install 'transformer[export]' (or pip install ctranslate2)"
        ) from None
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: one of {', '.join(QUANTIZATIONS)}")
    _refuse_non_finite(model, "the model")

    class _Ours(Converter):  # CTranslate2's own validate / optimize (quantize) / save
        def _load(self):
            return ctranslate2_spec(model, tokenizer)

    def build(directory: Path) -> None:
        _Ours().convert(str(directory), quantization=quantization)

    return _write_model_directory(out, overwrite, tokenizer, build, "ctranslate2")


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(  # errors in one line, as transformer-translate's
        prog="transformer-export",
        description="Write a checkpoint as a CTranslate2 model or as a shareable safetensors directory.",
    )
    parser.add_argument("checkpoint", help="a .pt checkpoint written by training (best.pt, avg.pt, ...)")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument(
        "--format",
        required=True,
        choices=[*FORMATS, *DEPRECATED_FORMATS],
        help="safetensors: model.safetensors + config.json + SentencePiece + a model card "
        "(README.md), loaded by Translator.from_pretrained and transformer-translate (not by "
        "HuggingFace transformers; hf is its old name); ctranslate2: for the CTranslate2 engine",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="with --format ctranslate2: weight type (default: float32 as trained)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a previous export in the output directory (refused if it holds anything else)",
    )
    args = parser.parse_args(argv)
    requested, export_format = args.format, DEPRECATED_FORMATS.get(args.format, args.format)
    if args.quantization and export_format != "ctranslate2":
        parser.error("--quantization applies to --format ctranslate2 only")
    try:
        check_output_directory(Path(args.output).resolve(), args.force)  # before reading the checkpoint
        import_torch_holding_interrupts()
        from transformer.checkpoint import load_checkpoint, model_from_checkpoint

        state = load_checkpoint(args.checkpoint)
        model, tokenizer, config = model_from_checkpoint(state, args.checkpoint)
        if export_format == "safetensors":
            trained = {"step": state.get("step"), "metrics": state.get("metrics")}
            out = save_pretrained(model, tokenizer, config, args.output, overwrite=args.force, trained=trained)
        else:
            out = export_ctranslate2(model, tokenizer, args.output, args.quantization, overwrite=args.force)
    except (CheckpointError, FileExistsError, ValueError) as error:
        print(f"transformer-export: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the output directory cannot be listed
        print(f"transformer-export: error: {error.filename or args.output}: {_failure_reason(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the staging directory is removed, a previous export kept
        next_interrupt_ends_at_once()
        print("transformer-export: interrupted; nothing was exported", file=sys.stderr)
        return 130
    if requested != export_format:
        print(
            f"transformer-export: warning: --format {requested} is deprecated (the directory is this package's "
            f"format, not a HuggingFace transformers model): use --format {export_format}, which writes the same "
            "files",
            file=sys.stderr,
        )
    print(f"wrote {out} ({export_format}{', ' + args.quantization if args.quantization else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
