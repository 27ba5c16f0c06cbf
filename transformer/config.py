"""Typed configuration: dataclasses that mirror the Hydra groups in `conf/`.

Hydra composes YAML; `Config.from_dict` turns the result into these dataclasses and rejects unknown
keys, wrong types and impossible values with an error that names the key and says what to do.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Hydra's config tree (absolute, so that any launcher finds it: -m, torchrun, console scripts).
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """A configuration value is unusable; the message names the key (e.g. `model.d_model`)."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.0
    pre_norm: bool = True
    tie_embeddings: bool = True
    max_positions: int = 1024

    def validate(self) -> None:
        for key in ("d_model", "n_heads", "d_ff", "encoder_layers", "decoder_layers", "max_positions"):
            _positive(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "choose n_heads that divides d_model (e.g. model.n_heads=8 for d_model=512)"
            )
        for key in ("dropout", "attention_dropout"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{key}={value} must be in [0, 1)")


@dataclass
class DataConfig:
    name: str = "toy"
    # Where the text comes from, first match wins: `path` (local directory or file), `hub_id`, `embedded`.
    path: str | None = None
    hub_id: str | None = None
    hub_config: str | None = None
    embedded: bool = False
    embedded_pairs: int = 12000
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "validation"
    test_split: str = "test"
    # File names of local splits when they differ from the split names (Multi30k: val, test_2016_flickr).
    local_splits: dict[str, str] = field(default_factory=dict)
    max_len: int = 256
    vocab_size: int = 8000
    tokenizer_type: str = "bpe"
    joint_vocab: bool = True
    character_coverage: float = 1.0
    tokenizer_sample: int = 1_000_000
    cache_dir: str = "data"

    def validate(self) -> None:
        _positive("data.max_len", self.max_len)
        _positive("data.vocab_size", self.vocab_size)
        if self.tokenizer_type not in ("bpe", "unigram"):
            raise ConfigError(f"data.tokenizer_type={self.tokenizer_type!r} must be 'bpe' or 'unigram'")
        if not (self.path or self.hub_id or self.embedded):
            raise ConfigError(
                f"data config {self.name!r} names no source: set data.path=DIR (local files), "
                "data.hub_id=NAME (HuggingFace hub) or data.embedded=true"
            )
        if self.src_lang == self.tgt_lang:
            raise ConfigError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")

    def split_name(self, split: str) -> str:
        return self.local_splits.get(split, split)


@dataclass
class TrainerConfig:
    device: str = "auto"
    precision: str = "auto"
    max_tokens: int = 4096
    update_freq: int = 1
    lr: float = 7e-4
    warmup: int = 4000
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    max_steps: int = 0
    max_epochs: int = 0
    max_minutes: float = 0.0
    validate_every: int = 1000
    checkpoint_every: int = 0
    val_beam_size: int = 1
    val_max_sentences: int = 0
    test_at_end: bool = True
    keep_last: int = 3
    patience: int = 0
    max_bad_steps: int = 20
    compile: bool = False
    seed: int = 1
    resume: Any = False
    init_from: str | None = None
    overwrite: bool = False
    log_every: int = 50
    num_threads: int = 0
    num_workers: int | None = None

    def validate(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"trainer.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"trainer.precision={self.precision!r} must be auto, bf16, fp16 or fp32")
        for key in ("max_tokens", "update_freq", "validate_every", "log_every"):
            _positive(f"trainer.{key}", getattr(self, key))
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be > 0 (e.g. trainer.lr=7e-4)")
        for key in ("warmup", "max_steps", "max_epochs", "keep_last", "patience", "checkpoint_every",
                    "val_max_sentences", "num_threads", "weight_decay", "clip_norm", "max_minutes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 0 (0 disables it)")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"trainer.num_workers={self.num_workers} must be >= 0 (or null: 2 on CUDA, 0 on a CPU)")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"trainer.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"trainer.betas={self.betas} must be two numbers in [0, 1)")
        _positive("trainer.val_beam_size", self.val_beam_size)
        _positive("trainer.max_bad_steps", self.max_bad_steps)
        if not (self.max_steps or self.max_epochs or self.max_minutes):
            raise ConfigError(
                "no stopping rule: set trainer.max_steps, trainer.max_epochs or trainer.max_minutes"
            )
        if not isinstance(self.resume, (bool, str)):
            raise ConfigError(f"trainer.resume={self.resume!r} must be true, false or a checkpoint path")


# Source tokens x beam per decoding batch. How much to decode at once depends on the machine, not the
# model, so `transformer-translate` uses this rather than the value saved in an older checkpoint.
DEFAULT_BATCH_TOKENS = 16384


@dataclass
class DecodeConfig:
    name: str = "beam"
    beam_size: int = 5
    alpha: float = 0.6
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    nbest: int = 1

    def validate(self) -> None:
        _positive("decode.beam_size", self.beam_size)
        _positive("decode.batch_tokens", self.batch_tokens)
        _positive("decode.nbest", self.nbest)
        if self.nbest > self.beam_size:
            raise ConfigError(f"decode.nbest={self.nbest} cannot exceed decode.beam_size={self.beam_size}")
        if self.alpha < 0 or self.max_len_a < 0 or self.max_len_b < 0:
            raise ConfigError("decode.alpha, decode.max_len_a and decode.max_len_b must be >= 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    run_dir: str | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        """Build and validate from a plain dict (e.g. `OmegaConf.to_container(cfg, resolve=True)`)."""
        raw = {k: v for k, v in raw.items() if k != "hydra"}
        config = _build(cls, raw, prefix="")
        config.validate()
        return config

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.trainer.validate()
        self.decode.validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")


def _build(cls: type, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; known keys: "
            f"{', '.join(sorted(known))}"
        )
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, prefix=key + ".")
        else:
            values[name] = _coerce(key, hint, value)
    return cls(**values)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check `value` against a simple type hint; ints are accepted for floats."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, option, value)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {hint}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        (item,) = typing.get_args(hint)
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be a number")
    if not isinstance(value, hint):
        raise ConfigError(f"{key}={value!r} must be of type {hint.__name__}")
    return value
