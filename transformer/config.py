"""The one config schema: these dataclasses hold every key, its type and its default.

They are registered in Hydra's ConfigStore (`schema`, and the default option of each group), so Hydra
itself rejects unknown keys and wrong types while composing; the YAML presets in `conf/` (shipped
inside the package) only override values. `Config.from_dict` builds the dataclasses from the composed
result (or a checkpoint's saved config) and rejects impossible values with an error that names the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Hydra's config tree, inside the package (absolute, so that any launcher finds it: -m, torchrun,
# console scripts, an installed wheel).
CONF_DIR = Path(__file__).resolve().parent / "conf"


# `model.attention`: what each one does is said in transformer/attention.py, which takes this list.
ATTENTION_BACKENDS = ("auto", "sdpa", "matmul", "math")


class ConfigError(ValueError):
    """A configuration value is unusable; the message names the key (e.g. `model.d_model`)."""


@dataclass
class ModelConfig:
    """`model=tiny` (these defaults) and the presets model/small, base, big."""
    name: str = "tiny"
    d_model: int = 128            # model width D (embeddings, residual stream)
    n_heads: int = 4              # attention heads; must divide d_model
    d_ff: int = 512               # feed-forward inner width
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout: float = 0.1          # residual, embedding and feed-forward dropout, in [0, 1)
    attention_dropout: float = 0.0  # dropout on attention weights, in [0, 1)
    pre_norm: bool = True         # True: LayerNorm before each sublayer (stable); False: after (the paper)
    tie_embeddings: bool = True   # share target embeddings with the output layer (and the source, if joint)
    max_positions: int = 1024     # longest sequence the sinusoidal table covers; longer sources are truncated
    # auto (matmuls on a CPU; SDPA's flash/efficient/math kernels on a GPU) | sdpa (PyTorch's pick,
    # cuDNN included) | matmul | math (the reference formula); see transformer/attention.py
    attention: str = "auto"

    def validate(self) -> None:
        _require_finite("model", self)
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
        if self.attention not in ATTENTION_BACKENDS:
            raise ConfigError(f"model.attention={self.attention!r} must be one of {', '.join(ATTENTION_BACKENDS)}")


@dataclass
class DataConfig:
    """Every corpus's keys; a data/ preset (toy, custom, multi30k_*, ...) fills them in."""
    name: str = "custom"          # names the run directory (runs/NAME/...) and the cache entries
    # Where the text comes from, first match wins: `path` (local directory or file), `hub_id`, `embedded`.
    path: str | None = None       # local directory with {split}.{lang}, .tsv, .jsonl or .parquet files
    hub_id: str | None = None     # HuggingFace hub dataset id
    hub_config: str | None = None  # its configuration name, if it has several
    embedded: bool = False        # the generated corpus of transformer/toy.py (data=toy)
    embedded_pairs: int = 12000   # training pairs generated for the embedded corpus
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "validation"
    test_split: str = "test"
    # File stem per split when it differs from the split name (Multi30k: val, test_2016_flickr).
    local_splits: dict[str, str] = field(default_factory=dict)
    max_len: int = 256            # drop training pairs longer than this many tokens on either side
    vocab_size: int = 8000        # SentencePiece pieces (per language unless joint_vocab)
    tokenizer_type: str = "bpe"   # bpe | unigram
    joint_vocab: bool = True      # one vocabulary for both languages (lets the model tie all embeddings)
    character_coverage: float = 1.0  # SentencePiece: share of characters covered by the vocabulary
    tokenizer_sample: int = 1_000_000  # SentencePiece trains on a random sample of at most this many sentences
    cache_dir: str = "data"       # SentencePiece models (spm/) and encoded corpora (cache/, corpus/) go here

    def validate(self) -> None:
        _require_finite("data", self)
        _positive("data.max_len", self.max_len)
        _positive("data.vocab_size", self.vocab_size)
        if self.tokenizer_type not in ("bpe", "unigram"):
            raise ConfigError(f"data.tokenizer_type={self.tokenizer_type!r} must be 'bpe' or 'unigram'")
        if self.embedded and (self.path or self.hub_id):
            given = f"data.path={self.path}" if self.path else f"data.hub_id={self.hub_id}"
            raise ConfigError(
                f"{given} is set but data={self.name} is the embedded corpus, which ignores it; for your own "
                f"corpus select the custom preset: make train data=custom {given} "
                f"data.src_lang={self.src_lang} data.tgt_lang={self.tgt_lang}"
            )
        if not (self.path or self.hub_id or self.embedded):
            raise ConfigError(
                f"data config {self.name!r} names no source: set data.path=DIR (local files), "
                "data.hub_id=NAME (HuggingFace hub) or data.embedded=true"
            )
        if self.src_lang == self.tgt_lang:
            raise ConfigError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}")

    def split_name(self, split: str) -> str:
        return self.local_splits.get(split, split)


SCHEDULES = ("inverse_sqrt", "cosine", "linear", "constant")


@dataclass
class TrainerConfig:
    """`trainer=default`: the training loop. 0 disables a limit or a feature where noted."""
    device: str = "auto"          # auto | cpu | cuda | cuda:N  (auto = cuda when available)
    # auto = bf16 on a GPU that supports it (else fp16) and on CPUs with native bf16 (AVX512-BF16/AMX);
    # fp32 on other CPUs. Parameters and optimizer state stay fp32 in every mode.
    precision: str = "auto"       # auto | bf16 | fp16 | fp32
    max_tokens: int = 4096        # token budget per batch: sentences x max(padded source, padded target length)
    update_freq: int = 1          # gradient accumulation: batches per optimizer step
    lr: float = 7e-4              # peak learning rate, reached at the end of warm-up
    schedule: str = "inverse_sqrt"  # after warm-up: inverse_sqrt (lr ~ 1/sqrt(step)) | cosine | linear | constant
    warmup: int = 4000            # linear warm-up steps (every schedule)
    min_lr: float = 0.0           # where cosine and linear end at max_steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # Adam betas
    adam_eps: float = 1e-9
    weight_decay: float = 0.0     # decoupled (AdamW) weight decay
    clip_norm: float = 1.0        # clip the gradient norm to this; 0 = no clipping
    label_smoothing: float = 0.1  # in [0, 1)
    max_steps: int = 100000       # stop after this many optimizer steps (0 = no limit)
    max_epochs: int = 0           # stop after this many epochs (0 = no limit)
    max_minutes: float = 0.0      # stop after this much wall-clock time, validation included (0 = no limit)
    validate_every: int = 1000    # steps between validations (loss, BLEU, samples, best.pt)
    checkpoint_every: int = 0     # steps between step_N.pt/last.pt; 0 = validate_every
    val_beam_size: int = 1        # beam for validation BLEU (1 = greedy, fastest); the test uses decode.beam_size
    val_max_sentences: int = 0    # decode only the first N validation sentences (0 = all)
    test_at_end: bool = True      # translate the test split with the best checkpoint at the end; print BLEU
    keep_last: int = 3            # step_N.pt files kept (0 = keep all)
    # Weight averaging. Validation scores the raw weights and each average; best.pt holds whichever set
    # scores best (its `weights` entry says which). 0 disables either.
    ema_decay: float = 0.0        # exponential moving average of the weights after every update (e.g. 0.999)
    average_last: int = 0         # at the end, average the last N step_N.pt (see checkpoint_every, keep_last)
    patience: int = 0             # stop after this many validations without a BLEU improvement (0 = never)
    max_bad_steps: int = 20       # stop after this many consecutive non-finite steps (x10 under fp16)
    compile: bool = False         # torch.compile the model
    seed: int = 1                 # seeds parameters, dropout and the batch order
    resume: Any = False           # true = newest checkpoint in the run dir; or a checkpoint path
    init_from: str | None = None  # fine-tune: this checkpoint's weights and tokenizer; fresh optimizer and step
    overwrite: bool = False       # allow starting over in a run dir that already holds checkpoints
    log_every: int = 50           # steps between train.log lines / TensorBoard points
    num_threads: int = 0          # torch CPU threads (0 = PyTorch's default)
    num_workers: int | None = None  # DataLoader processes collating the next batches (null = 2 on CUDA, 0 on CPU)

    def validate(self) -> None:
        _require_finite("trainer", self)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"trainer.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.precision not in ("auto", "bf16", "fp16", "fp32"):
            raise ConfigError(f"trainer.precision={self.precision!r} must be auto, bf16, fp16 or fp32")
        for key in ("max_tokens", "update_freq", "validate_every", "log_every"):
            _positive(f"trainer.{key}", getattr(self, key))
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be > 0 (e.g. trainer.lr=7e-4)")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"trainer.schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"trainer.min_lr={self.min_lr} must be in [0, trainer.lr={self.lr}]")
        if self.schedule in ("cosine", "linear") and self.max_steps <= self.warmup:
            raise ConfigError(
                f"trainer.schedule={self.schedule} decays from trainer.warmup={self.warmup} to trainer.max_steps="
                f"{self.max_steps}: set trainer.max_steps above the warm-up (it fixes where the decay ends)"
            )
        for key in ("warmup", "max_steps", "max_epochs", "keep_last", "patience", "checkpoint_every",
                    "val_max_sentences", "num_threads", "weight_decay", "clip_norm", "max_minutes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 0 (0 disables it)")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"trainer.num_workers={self.num_workers} must be >= 0 (or null: 2 on CUDA, 0 on a CPU)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"trainer.ema_decay={self.ema_decay} must be in [0, 1) (0 = no EMA; e.g. 0.999)")
        if self.average_last == 1 or self.average_last < 0:
            raise ConfigError(f"trainer.average_last={self.average_last} must be 0 (off) or at least 2")
        if self.average_last and self.keep_last and self.keep_last < self.average_last:
            raise ConfigError(f"trainer.average_last={self.average_last} needs that many step_N.pt files: set "
                              f"trainer.keep_last={self.average_last} (now {self.keep_last})")
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
    """`decode=beam` (these defaults) and decode/greedy: the end-of-training test, make evaluate, and
    transformer-translate's defaults (taken from the checkpoint's config)."""
    name: str = "beam"
    beam_size: int = 5            # hypotheses kept per sentence (1 = greedy)
    alpha: float = 0.6            # GNMT length penalty ((5 + len) / 6) ** alpha; 0 = raw log-probability
    max_len_a: float = 1.2        # output length limit: max_len_a * source_len + max_len_b tokens
    max_len_b: int = 10
    batch_tokens: int = DEFAULT_BATCH_TOKENS  # source tokens x beam per decoding batch
    nbest: int = 1                # hypotheses returned per sentence (<= beam_size)

    def validate(self) -> None:
        _require_finite("decode", self)
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
    run_dir: str | None = None    # checkpoints, TensorBoard events, train.log; null = hydra.run.dir

    @classmethod
    def from_dict(cls, raw: dict) -> Config:
        """Build and validate from a plain dict (`OmegaConf.to_container(cfg, resolve=True)`, a checkpoint's
        saved config): the schema checks keys and types (keys missing from an older checkpoint take their
        defaults), `validate` the values."""
        from omegaconf import OmegaConf
        from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

        raw = {k: v for k, v in raw.items() if k != "hydra"}
        try:
            config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))
        except ConfigKeyError as error:
            section = error.full_key.rpartition(".")[0]
            known = [f.name for f in dataclasses.fields(cls)] if not section else \
                [f.name for f in dataclasses.fields(type(getattr(cls(), section)))]
            raise ConfigError(f"unknown config key {error.full_key}; known keys: {', '.join(sorted(known))}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(composition_error_line(error)) from None
        config.validate()
        return config

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.trainer.validate()
        self.decode.validate()
        # A training pair of data.max_len tokens takes one position more: the source its EOS, the
        # target input its BOS. (Decoding caps its output at model.max_positions - 1 tokens itself.)
        if self.model.max_positions < self.data.max_len + 1:
            raise ConfigError(
                f"model.max_positions={self.model.max_positions} is too small for data.max_len={self.data.max_len}: "
                f"a sentence of {self.data.max_len} tokens and its EOS (source) or BOS (target) take "
                f"{self.data.max_len + 1} positions; set model.max_positions={self.data.max_len + 1} or more, or "
                f"data.max_len={self.model.max_positions - 1} or less")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def register_schema() -> None:
    """Put the dataclasses into Hydra's ConfigStore: `schema` types the whole tree (conf/config.yaml
    lists it first), and each group's default option is its dataclass (no YAML copy of a default)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    # Hydra makes the composed tree "struct" (no new keys); this mapping's keys are the user's to add:
    # data.local_splits='{validation: dev, test: newstest2014}' on the command line.
    OmegaConf.set_struct(schema.data.local_splits, False)
    store.store(name="schema", node=schema)
    store.store(group="model", name="tiny", node=ModelConfig)
    store.store(group="trainer", name="default", node=TrainerConfig)
    store.store(group="decode", name="beam", node=DecodeConfig)


register_schema()


def compose(overrides: list[str] = (), config_name: str = "config") -> Config:
    """The config `make train key=value ...` would see, composed with Hydra's compose API (for tools
    that make no run directory: prepare, bench, tests). Errors become one ConfigError line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = hydra_compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(composition_error_line(error)) from None
    return Config.from_dict(OmegaConf.to_container(raw, resolve=True))


def composition_error_line(error: BaseException) -> str:
    """One line from a Hydra composition error or an OmegaConf error: the message with its full key."""
    cause = error.__cause__ or error
    key = getattr(cause, "full_key", None)
    message = str(getattr(cause, "msg", None) or cause).splitlines()[0]
    head = str(error).splitlines()[0]
    if key and key not in message:
        message = f"{key}: {message}"
    return message if cause is error else f"{head}: {message}"


def _require_finite(section: str, values) -> None:
    """Every float key of a config section (lists of floats too) holds a finite number: nan and inf
    pass comparisons such as `lr <= 0` unnoticed, then train nothing or make every weight non-finite."""
    for spec in dataclasses.fields(values):
        if "float" not in str(spec.type):
            continue
        value = getattr(values, spec.name)
        numbers = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(number, float) and not math.isfinite(number) for number in numbers):
            default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            raise ConfigError(f"{section}.{spec.name}={value} is not finite; give a finite number "
                              f"(the default is {default})")


def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")
