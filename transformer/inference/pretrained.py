"""The shareable safetensors directory: `transformer-export CKPT --format safetensors OUT` writes it
(`save_pretrained`), `Translator.from_pretrained` reads it (`load_pretrained`), from disk or from the
HuggingFace Hub. It holds no pickle. It is this package's format, not a `transformers` model.

    model.safetensors    the weights (a tied matrix stored once)
    config.json          the training config (model shape, languages, decoding defaults) and the format version
    spm.model            the joint SentencePiece model, or src.spm.model and tgt.spm.model
    README.md            the model card (model_card.py)
    export-manifest.json the names of the files the export wrote and their SHA-256 digests
                         (model_directory.py), against which `load_pretrained` checks the weights and the
                         SentencePiece models it reads (config.json and README.md are left free to edit)

Every exported file gets the permissions of a file created normally under the umask (safetensors writes
through an owner-only temporary file). torch comes with the functions that need it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from transformer.config import Config, ConfigError
from transformer.data.tokenizer import Tokenizer
from transformer.errors import NESTED_TOO_DEEPLY, CheckpointError, symlink_loop
from transformer.inference.model_card import model_card
from transformer.inference.model_directory import (
    CARD_FILE,
    CONFIG_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    TITLES_FILE,
    TOKENIZER_LAYOUTS,
    WEIGHTS_FILE,
    check_recorded_digest,
    output_directory,
    recorded_digests,
    tokenizer_files,
    write_model_directory,
)

if TYPE_CHECKING:
    from transformer.model import Transformer

TOO_DEEP = f"{NESTED_TOO_DEEPLY}: export the model again from its checkpoint"


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

    from transformer.kernels import is_int8

    if is_int8(model):
        raise ValueError(
            "save_pretrained takes the float model, not an int8 one: save the model of "
            "Translator.from_checkpoint(path) without quantize=, and quantize when loading it "
            '(Translator.from_pretrained(directory, quantize="int8"))'
        )
    refuse_non_finite(model, "the model")
    config = without_local_paths(config)
    card = model_card(model, tokenizer, config, output_directory(out).name, trained or {})

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

    return write_model_directory(out, overwrite, tokenizer, build, "safetensors")


def without_local_paths(config: Config) -> Config:
    """`config` with every absolute path in it (data.path, a corpus's path, data.cache_dir, trainer.init_from,
    trainer.resume, run_dir) cut to its last part: an export is shared, and the directories of the
    machine it was trained on (a home directory, a user name) are nobody else's business. A relative path
    stays as it was given."""

    def local(value):
        if isinstance(value, dict):
            return {key: local(item) for key, item in value.items()}
        if isinstance(value, list):
            return [local(item) for item in value]
        if isinstance(value, str) and (value.startswith("~") or PurePosixPath(value).is_absolute()):
            return PurePosixPath(value).name or "."
        return value

    return Config.from_dict(local(config.to_dict()), saved=True)


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
    except RecursionError:
        raise CheckpointError(f"{config_path}: {TOO_DEEP}") from None
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
    except RecursionError:
        raise CheckpointError(f"{config_path}: {TOO_DEEP}") from None
    names = meta.get("tokenizer") or []
    if names not in TOKENIZER_LAYOUTS:
        raise CheckpointError(
            f'{config_path}: unknown tokenizer files {names!r} (an export lists ["spm.model"] '
            f'or ["src.spm.model", "tgt.spm.model"], each maybe with "{TITLES_FILE}"); the file is damaged'
        )
    digests = recorded_digests(folder)
    for name in names:
        check_recorded_digest(folder, name, digests)
    models = []
    for name in names:
        try:
            models.append((folder / name).read_bytes())
        except OSError as error:
            raise CheckpointError(f"{folder}: {error.strerror}: {error.filename}") from None
        if not models[-1]:  # SentencePiece would load it as a model of no pieces, and say so only later
            raise CheckpointError(
                f"{folder / name}: an empty file (0 bytes), not a SentencePiece model; copy or download the "
                "exported directory again, or export it again from its checkpoint"
            )
    try:
        titles = models.pop() if names[-1] == TITLES_FILE else None
        tokenizer = Tokenizer(*models, titles=titles)
    except RuntimeError as error:  # sentencepiece: not a model (e.g. a git-lfs pointer cloned without lfs)
        raise CheckpointError(
            f"{folder}: {', '.join(names)}: not a SentencePiece model ({str(error).splitlines()[0]}); "
            "if the directory was cloned with git, fetch its LFS files (git lfs pull)"
        ) from None
    except ValueError as error:  # a table of usual titles beside a vocabulary without inline casing
        raise CheckpointError(f"{folder}: {error}") from None
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{folder}: no {WEIGHTS_FILE}")
    check_recorded_digest(folder, WEIGHTS_FILE, digests)
    try:
        shapes = safetensors_shapes(weights)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({str(error).splitlines()[0]})") from None
    from transformer.checkpoint import check_config_matches_weights
    from transformer.model import build_model

    check_config_matches_weights(config.model, shapes, tokenizer, config_path)  # before a model is built
    model = build_model(
        config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint, initialize=False
    )  # every weight is loaded next (missing ones are refused)
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
    refuse_non_finite(model, weights)
    return model, tokenizer, config


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of a safetensors file, from its header (no tensor is read); a tied
    matrix, stored once, under each of its names (save_model records the names it left out in the
    header's metadata, each mapped to the name kept)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
        aliases = file.metadata() or {}
    for name, kept in aliases.items():
        if kept in shapes:
            shapes.setdefault(name, shapes[kept])
    return shapes


def refuse_non_finite(model: Transformer, where: str | Path) -> None:
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
        and not symlink_loop(text)  # exists() says False there too
        and Path(text).suffix != ".pt"
    )


def _download(repo_id: str) -> Path:
    if not looks_like_hub_id(repo_id):
        raise CheckpointError(f"{repo_id}: no such directory (a HuggingFace Hub id looks like owner/name)")
    from transformer.data.hub import cache_only_without_network

    offline = cache_only_without_network()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id))
    except Exception as error:  # offline, unknown repository, no access: one line either way
        reason = offline or f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise CheckpointError(
            f"{repo_id}: not a local directory, and the HuggingFace Hub did not provide it ({reason})"
        ) from None
