"""Parallel data: load text pairs, check them, encode them (cached), and pack token-budget batches.

Sources, first match wins: `data.path` (a directory of `{split}.{lang}` files, `{split}.tsv`,
`{split}.jsonl` or `{split}.parquet`), `data.hub_id` (HuggingFace hub), `data.embedded` (generated).
Bad input never becomes silently mis-aligned data: a line-count mismatch or invalid UTF-8 stops with
the file and line; empty, NUL-containing and over-long pairs are dropped with a logged count.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from transformer import toy
from transformer.config import DataConfig
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, corpus_fingerprint

log = logging.getLogger(__name__)


def _datasets():
    """HuggingFace `datasets`, imported on first use: translating needs none of it and starts faster."""
    import datasets
    datasets.logging.set_verbosity_error()
    return datasets


class DataError(ValueError):
    """Input data cannot be used; the message names the file (and line) or the config key."""


# ---------------------------------------------------------------------------------------------------
# Reading text


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file. Strips a BOM and CR line ends; only '\\n' separates lines
    (str.splitlines would also split on U+2028 and friends and mis-align a parallel corpus)."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_no = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataError(
            f"{path}:{line_no}: invalid UTF-8 (byte 0x{raw[error.start]:02x} at column {column}); "
            "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8`"
        ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_parallel_files(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    for path in (src_path, tgt_path):
        if not path.is_file():
            raise DataError(f"{path}: file not found (check data.path and the language codes)")
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}; "
            "a parallel corpus needs one target line per source line"
        )
    return src, tgt


def read_tsv(path: Path) -> tuple[list[str], list[str]]:
    src, tgt = [], []
    for line_no, line in enumerate(read_lines(path), 1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{path}:{line_no}: expected 2 tab-separated fields (source, target), "
                            f"found {len(fields)}")
        src.append(fields[0])
        tgt.append(fields[1])
    return src, tgt


def _columns(table, cfg: DataConfig, where: str) -> tuple[list[str], list[str]]:
    if "translation" in table.column_names:
        pairs = table["translation"]
        try:
            return [p[cfg.src_lang] for p in pairs], [p[cfg.tgt_lang] for p in pairs]
        except (KeyError, TypeError):
            raise DataError(f"{where}: 'translation' entries lack {cfg.src_lang!r}/{cfg.tgt_lang!r} keys; "
                            "check data.src_lang and data.tgt_lang") from None
    for src_col, tgt_col in ((cfg.src_lang, cfg.tgt_lang), ("src", "tgt"), ("source", "target")):
        if src_col in table.column_names and tgt_col in table.column_names:
            return list(table[src_col]), list(table[tgt_col])
    raise DataError(f"{where}: no 'translation' column and no {cfg.src_lang!r}/{cfg.tgt_lang!r} columns "
                    f"(found {table.column_names})")


def load_split_text(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """Source and target lines of one split ("train", "validation" or "test" in config terms)."""
    split_key = {"train": cfg.train_split, "validation": cfg.valid_split, "test": cfg.test_split}.get(split, split)
    if cfg.path:
        return _load_local(cfg, split_key)
    if cfg.hub_id:
        return _load_hub(cfg, split_key)
    pairs = toy.generate(cfg.embedded_pairs)
    canonical = {cfg.train_split: "train", cfg.valid_split: "validation", cfg.test_split: "test"}
    if canonical.get(split_key) not in pairs:
        raise DataError(f"the embedded corpus has splits train, validation, test; not {split_key!r}")
    return pairs[canonical[split_key]]


def _load_local(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    root = Path(cfg.path).expanduser()
    if not root.exists():
        raise DataError(f"data.path={cfg.path}: no such file or directory")
    name = cfg.split_name(split)
    if root.is_file():
        candidates = [root]
    else:
        src_file, tgt_file = root / f"{name}.{cfg.src_lang}", root / f"{name}.{cfg.tgt_lang}"
        if src_file.exists() or tgt_file.exists():
            return read_parallel_files(src_file, tgt_file)
        candidates = [root / f"{name}.{ext}" for ext in ("tsv", "jsonl", "json", "parquet")]
    for file in candidates:
        if not file.is_file():
            continue
        if file.suffix == ".tsv":
            return read_tsv(file)
        builder = "parquet" if file.suffix == ".parquet" else "json"
        try:
            table = _datasets().load_dataset(builder, data_files=str(file), split="train")
        except Exception as error:  # datasets raises many types for malformed files
            raise DataError(f"{file}: cannot be read as {builder}: {error}") from None
        return _columns(table, cfg, str(file))
    raise DataError(
        f"data.path={cfg.path}: no files for split {split!r}; expected {name}.{cfg.src_lang} + "
        f"{name}.{cfg.tgt_lang}, or {name}.tsv / {name}.jsonl / {name}.parquet"
    )


def _load_hub(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    try:
        table = _datasets().load_dataset(cfg.hub_id, cfg.hub_config, split=split)
    except Exception as error:  # offline, unknown id, unknown split: all surface as different types
        raise DataError(
            f"data.hub_id={cfg.hub_id}: cannot load split {split!r} from the HuggingFace hub "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            "Without network access use local files: data.path=DIR"
        ) from None
    return _columns(table, cfg, f"hub dataset {cfg.hub_id}")


# ---------------------------------------------------------------------------------------------------
# Encoding


@dataclass
class EncodedSplit:
    src: list[list[int]]
    tgt: list[list[int]]
    src_text: list[str]
    tgt_text: list[str]

    def __len__(self) -> int:
        return len(self.src)


def encode_split(src_text: list[str], tgt_text: list[str], tokenizer: Tokenizer, *, cache_dir: str | Path,
                 max_len: int | None, name: str) -> EncodedSplit:
    """Encode with `datasets.map` (cached on disk by corpus and tokenizer) and drop unusable pairs."""
    model_hash = hashlib.sha256(tokenizer.src_model_bytes + tokenizer.tgt_model_bytes).hexdigest()[:12]
    key = corpus_fingerprint(src_text, tgt_text, {"tokenizer": model_hash})
    cache_file = Path(cache_dir) / "cache" / f"{name}.{key}.arrow"
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    table = _datasets().Dataset.from_dict({"src": src_text, "tgt": tgt_text})

    def encode(batch):
        return {"src_ids": tokenizer.encode_src(batch["src"]), "tgt_ids": tokenizer.encode_tgt(batch["tgt"])}

    encoded = table.map(encode, batched=True, batch_size=5000, cache_file_name=str(cache_file),
                        load_from_cache_file=True, desc=f"encoding {name}")
    src_ids, tgt_ids = encoded["src_ids"], encoded["tgt_ids"]
    keep, dropped = [], {"empty": 0, "NUL byte": 0, "too long": 0}
    for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
        if not s or not t or not src_text[i].strip() or not tgt_text[i].strip():
            dropped["empty"] += 1
        elif "\0" in src_text[i] or "\0" in tgt_text[i]:
            dropped["NUL byte"] += 1
        elif max_len is not None and (len(s) > max_len or len(t) > max_len):
            dropped["too long"] += 1
        else:
            keep.append(i)
    total = sum(dropped.values())
    if total:
        log.warning("%s: dropped %d of %d pairs (%s; data.max_len=%s)", name, total, len(src_ids),
                    ", ".join(f"{k}: {v}" for k, v in dropped.items() if v), max_len)
    if not keep:
        raise DataError(f"{name}: no usable sentence pairs left after filtering (all empty or longer than "
                        f"data.max_len={max_len})")
    return EncodedSplit([src_ids[i] for i in keep], [tgt_ids[i] for i in keep],
                        [src_text[i] for i in keep], [tgt_text[i] for i in keep])


# ---------------------------------------------------------------------------------------------------
# Batching


@dataclass
class Batch:
    src: torch.Tensor        # (B, S) int64, EOS-terminated, PAD-padded
    tgt_in: torch.Tensor     # (B, T) BOS + target
    tgt_out: torch.Tensor    # (B, T) target + EOS
    num_tgt_tokens: int

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch(self.src.to(device, non_blocking=non_blocking),
                     self.tgt_in.to(device, non_blocking=non_blocking),
                     self.tgt_out.to(device, non_blocking=non_blocking), self.num_tgt_tokens)

    def padding_share(self) -> float:
        real = (self.src != PAD_ID).sum().item() + (self.tgt_out != PAD_ID).sum().item()
        return 1.0 - real / (self.src.numel() + self.tgt_out.numel())


def pad_sequences(seqs: list[list[int]], prefix: list[int] = (), suffix: list[int] = ()) -> torch.Tensor:
    length = max(len(s) for s in seqs) + len(prefix) + len(suffix)
    out = torch.full((len(seqs), length), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(seqs):
        full = [*prefix, *seq, *suffix]
        out[row, : len(full)] = torch.tensor(full, dtype=torch.long)
    return out


def collate(split: EncodedSplit, indices: list[int]) -> Batch:
    src = pad_sequences([split.src[i] for i in indices], suffix=[EOS_ID])
    tgt = [split.tgt[i] for i in indices]
    tgt_in = pad_sequences(tgt, prefix=[BOS_ID])
    tgt_out = pad_sequences(tgt, suffix=[EOS_ID])
    return Batch(src, tgt_in, tgt_out, num_tgt_tokens=sum(len(t) + 1 for t in tgt))


class TokenBatchSampler:
    """Length-bucketed batches under a token budget, reshuffled per epoch from the seed.

    Pairs are sorted by (source length, target length, random tie-break) and packed greedily so that
    `n_sentences * max(padded_src_len, padded_tgt_len) <= max_tokens`; the batch order is then
    shuffled. An epoch's batches depend only on (seed, epoch), so a position in an epoch is all the
    state needed to resume exactly.
    """

    def __init__(self, src_lens: list[int], tgt_lens: list[int], max_tokens: int, seed: int):
        self.src_lens = np.asarray(src_lens, dtype=np.int64) + 1   # + EOS
        self.tgt_lens = np.asarray(tgt_lens, dtype=np.int64) + 1   # + BOS/EOS
        self.max_tokens = max_tokens
        self.seed = seed
        longest = int(max(self.src_lens.max(), self.tgt_lens.max()))
        if longest > max_tokens:
            raise DataError(
                f"trainer.max_tokens={max_tokens} is smaller than the longest sentence ({longest} tokens); "
                f"raise trainer.max_tokens or lower data.max_len"
            )

    def batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        tie_break = rng.random(len(self.src_lens))
        order = np.lexsort((tie_break, self.tgt_lens, self.src_lens))
        widths = np.maximum(self.src_lens, self.tgt_lens)[order]
        batches = pack_batches(order.tolist(), widths.tolist(), self.max_tokens)
        permutation = rng.permutation(len(batches))
        return [batches[i] for i in permutation]


def pack_batches(order: list[int], widths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedily cut `order` into batches with n_sentences * widest padded sentence <= max_tokens.

    `widths[k]` is the padded width of the sentence `order[k]`; a sentence wider than the budget
    still gets a batch of its own (callers refuse such budgets before training).
    """
    batches, current, width = [], [], 0
    for index, item_width in zip(order, widths):
        new_width = max(width, item_width)
        if current and (len(current) + 1) * new_width > max_tokens:
            batches.append(current)
            current, new_width = [], item_width
        current.append(index)
        width = new_width
    if current:
        batches.append(current)
    return batches


def batches_in_order(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Deterministic length-sorted batches for evaluation/decoding (no shuffling); +1 for EOS."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return pack_batches(order, [lengths[i] + 1 for i in order], max_tokens)
