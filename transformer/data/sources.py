"""Parallel text: where a split comes from, its fingerprint, and its lines in bounded chunks.

Sources, first match wins: `data.path` (a directory of `{split}.{lang}` files, `{split}.tsv`,
`{split}.jsonl` or `{split}.parquet`), `data.hub_id` (HuggingFace hub), `data.embedded` (generated).
A source is streamed in chunks of lines, never held whole, so a corpus of millions of pairs costs
memory in proportion to a chunk; Arrow tables from `datasets` stay memory-mapped Arrow. Bad input
never becomes silently mis-aligned data: a line-count mismatch, invalid UTF-8 or a malformed TSV line
stops with the file and line.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from transformer.config import DataConfig
from transformer.data import toy
from transformer.data.lines import (
    count_lines,
    dangling_link,
    file_stat,
    hash_files,
    iter_line_blocks,
    lines_at,
    not_regular,
    rechunk,
    refuse_irregular,
)
from transformer.errors import DataError  # noqa: F401 - its home is errors.py; imported from here too
from transformer.install import install_hint

log = logging.getLogger(__name__)


CHUNK_LINES = 100_000
SAMPLE_SEED = 20261202  # the tokenizer's sample of a large corpus (`sample_lines`): the same for the same content


def pa_types():
    import pyarrow.types

    return pyarrow.types


def _datasets(source: str):
    """HuggingFace `datasets`, imported on first use: translating, and training on plain-text or TSV
    files, need none of it (nor pyarrow): it is the [data] extra. `source` names what needs it."""
    try:
        import datasets
    except ImportError:
        hint = install_hint("data")
        raise DataError(f"{source}: needs HuggingFace datasets, which reads it: {hint}") from None
    datasets.logging.set_verbosity_error()
    return datasets


Chunk = tuple[list[str], list[str]]  # (source lines, target lines) of equal length


class SplitSource:
    """One split of a parallel corpus. `chunks()` streams (source lines, target lines);
    `fingerprint()` identifies the content (cache keys; computed once); `where` names it in messages."""

    where: str
    files: tuple[Path, ...] = ()  # the files read (their content is what the fingerprint hashes)
    memo: Path | None = None  # where the hashes of unchanged files are remembered (`hash_files`)
    _fingerprint: str | None = None
    _stats: list | None = None

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._stats = [file_stat(path) for path in self.files]
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def changed_since_fingerprint(self) -> list[Path]:
        """The files whose size or modification time moved since `fingerprint()` read them: written to
        while this process read them (a cache entry under the old content's key would hold a mix)."""
        if self._stats is None:
            return []
        return [path for path, before in zip(self.files, self._stats) if file_stat(path) != before]

    def _compute_fingerprint(self) -> str:
        raise NotImplementedError

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        raise NotImplementedError

    def read_all(self) -> Chunk:
        src, tgt = [], []
        for s, t in self.chunks():
            src.extend(s)
            tgt.extend(t)
        return src, tgt

    def sample_lines(self, sides: tuple[str, ...], count: int) -> list[str] | None:
        """A uniform random sample of `count` of the lines of `sides`, the same every time for the same
        content, or None where the source cannot draw one cheaply or has no more than `count` lines (the
        tokenizer then streams every line, `lines`)."""
        return None

    def lines(self, *sides: str) -> _Lines:
        """A re-iterable over the lines of `sides` ("src", "tgt" or both, chunk by chunk), streamed
        anew on every pass: one pass over the split feeds a joint vocabulary both of its sides."""
        return _Lines(self, [("src", "tgt").index(side) for side in sides])


class _Lines:
    def __init__(self, source: SplitSource, indices: list[int]):
        self.source, self.indices = source, indices

    def __iter__(self):
        for chunk in self.source.chunks():
            for index in self.indices:
                yield from chunk[index]


class ParallelFiles(SplitSource):
    """`{split}.{src_lang}` and `{split}.{tgt_lang}`: line i of one translates line i of the other."""

    def __init__(self, src_path: Path, tgt_path: Path):
        for path in (src_path, tgt_path):
            if not path.exists():
                raise DataError(
                    f"{path}: {dangling_link(path) or 'file not found'} (check data.path and the language codes)"
                )
            refuse_irregular(path)
        self.src_path, self.tgt_path = src_path, tgt_path
        self.files = (src_path, tgt_path)
        self.where = f"{src_path} + {tgt_path.name}"

    def _compute_fingerprint(self) -> str:
        return hash_files(self.src_path, self.tgt_path, memo=self.memo)

    def sample_lines(self, sides: tuple[str, ...], count: int) -> list[str] | None:
        """Line numbers drawn without replacement (a fixed seed) among the lines of the sides' files, counted
        in their bytes, then those lines read; in file order."""
        paths = [{"src": self.src_path, "tgt": self.tgt_path}[side] for side in sides]
        counts = [count_lines(path) for path in paths]
        if sum(counts) <= count:
            return None
        chosen = np.sort(np.random.default_rng(SAMPLE_SEED).choice(sum(counts), size=count, replace=False))
        bounds = np.cumsum([0, *counts])
        return [
            line
            for path, low, high in zip(paths, bounds[:-1], bounds[1:])
            for line in lines_at(path, chosen[(chosen >= low) & (chosen < high)] - low)
        ]

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        src_chunks = rechunk(iter_line_blocks(self.src_path), size)
        tgt_chunks = rechunk(iter_line_blocks(self.tgt_path), size)
        src_count = tgt_count = 0
        while True:
            src, tgt = next(src_chunks, None), next(tgt_chunks, None)
            src_count += len(src or ())
            tgt_count += len(tgt or ())
            if src is None and tgt is None:
                return
            if src is None or tgt is None or len(src) != len(tgt):
                src_count += sum(map(len, src_chunks))
                tgt_count += sum(map(len, tgt_chunks))
                raise DataError(
                    f"line counts differ: {self.src_path} has {src_count} lines, {self.tgt_path} has "
                    f"{tgt_count}; a parallel corpus needs one target line per source line"
                )
            yield src, tgt


class TsvFile(SplitSource):
    """`{split}.tsv`: source TAB target per line. A first line naming the columns as JSONL and Parquet
    files name them (the two language codes, src/tgt or source/target: what pandas' to_csv writes first)
    is a header, not a pair. Fields are plain text: CSV quoting is not undone (a warning says so)."""

    def __init__(self, path: Path, src_lang: str = "", tgt_lang: str = ""):
        self.path, self.where, self.files = path, str(path), (path,)
        self.header = {(src_lang, tgt_lang), ("src", "tgt"), ("source", "target")}

    def _compute_fingerprint(self) -> str:
        return "tsv-with-header-" + hash_files(self.path, memo=self.memo)  # a header line was read as a pair before

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        line_no, quoted = 0, None
        for lines in rechunk(iter_line_blocks(self.path), size):
            src, tgt = [], []
            for line in lines:
                line_no += 1
                fields = line.split("\t")
                if len(fields) != 2:
                    hint = (
                        (
                            "; a field in CSV quotes holding a TAB or a line break? Write the file without quoting "
                            "(csv.QUOTE_NONE) or as JSONL"
                        )
                        if line.lstrip().startswith('"')
                        else ""
                    )
                    raise DataError(
                        f"{self.path}:{line_no}: expected 2 tab-separated fields (source, target), "
                        f"found {len(fields)}{hint}"
                    )
                if line_no == 1 and (fields[0].strip().lower(), fields[1].strip().lower()) in self.header:
                    log.info("%s: line 1 (%s, %s) is a header, not a pair: skipped", self.path, *fields)
                    continue
                if quoted is None and (_csv_quoted(fields[0]) or _csv_quoted(fields[1])):
                    quoted = line_no
                src.append(fields[0])
                tgt.append(fields[1])
            yield src, tgt
        if quoted is not None and self.path not in _WARNED_QUOTED:
            _WARNED_QUOTED.add(self.path)
            log.warning(
                '%s:%d: a field in CSV quotes ("...""...", as pandas\' to_csv writes a field holding a '
                "quote): TSV fields are read as plain text, quotes kept; write the file with "
                "quoting=csv.QUOTE_NONE, or as JSONL",
                self.path,
                quoted,
            )


_WARNED_QUOTED: set[Path] = set()  # each file is read several times (tokenizer sample, encoding, test)


def _csv_quoted(field: str) -> bool:
    """Whether `field` looks written by a CSV writer: inside enclosing quotes, every quote doubled."""
    if len(field) < 4 or field[0] != '"' or field[-1] != '"' or '""' not in field[1:-1]:
        return False
    return '"' not in field[1:-1].replace('""', "")


class ArrowTable(SplitSource):
    """A `datasets.Dataset` (hub, JSONL, Parquet): memory-mapped Arrow, read a record batch at a time.
    Columns: `translation: {src_lang: .., tgt_lang: ..}`, or two text columns (the language codes,
    src/tgt or source/target)."""

    def __init__(self, table, cfg: DataConfig, where: str, content: str | None = None):
        self.table, self.where, self.content = table, where, content  # content: a local file's hash
        self.src_lang, self.tgt_lang = cfg.src_lang, cfg.tgt_lang
        names = table.column_names
        if "translation" in names:
            self.columns = None
            arrow_type = table.data.schema.field("translation").type
            keys = (
                {arrow_type.field(i).name for i in range(arrow_type.num_fields)}
                if pa_types().is_struct(arrow_type)
                else None
            )
            if keys is None or not {cfg.src_lang, cfg.tgt_lang} <= keys:
                found = f"keys {sorted(keys)}" if keys is not None else f"type {arrow_type}"
                raise DataError(
                    f"{where}: the 'translation' column must map {cfg.src_lang!r} and {cfg.tgt_lang!r} "
                    f"to text (found {found}); check data.src_lang and data.tgt_lang"
                )
            self.binary = {
                f"translation.{lang}": self._text_type(arrow_type.field(lang).type, f"translation.{lang}")
                for lang in (cfg.src_lang, cfg.tgt_lang)
            }
            return
        for src_col, tgt_col in ((cfg.src_lang, cfg.tgt_lang), ("src", "tgt"), ("source", "target")):
            if src_col in names and tgt_col in names:
                self.columns = (src_col, tgt_col)
                self.binary = {col: self._text_type(table.data.schema.field(col).type, col) for col in self.columns}
                return
        raise DataError(
            f"{where}: no 'translation' column and no {cfg.src_lang!r}/{cfg.tgt_lang!r} columns (found {names})"
        )

    def _text_type(self, arrow_type, column: str) -> bool:
        """Whether `column` holds UTF-8 bytes (True) or strings (False); anything else (numbers, lists, or
        `datasets`' JSON type, which a JSONL file gets where one row holds a non-string) is refused with
        the first record that is not text: str() of it would train on quoted or escaped text."""
        types = pa_types()
        if types.is_string(arrow_type) or types.is_large_string(arrow_type) or types.is_null(arrow_type):
            return False
        if types.is_binary(arrow_type) or types.is_large_binary(arrow_type):
            return True
        record, value = self._first_non_text(column)
        where = f"record {record + 1} holds {value!r}" if record is not None else f"its type is {arrow_type}"
        raise DataError(
            f"{self.where}: column {column!r} must hold text in every record ({where}); make every "
            "value a JSON string (or null), or fix the file's column types"
        )

    def _first_non_text(self, column: str) -> tuple[int | None, object]:
        import json

        first = 0
        for batch in self.table.data.to_batches():
            values = self._column(batch, column)
            for i, value in enumerate(values.to_pylist()):
                if str(values.type) == "extension<arrow.json>" and isinstance(value, str):
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                if value is not None and not isinstance(value, str):
                    return first + i, value
            first += len(batch)
        return None, None

    def _text(self, values: list, column: str, first: int) -> list[str]:
        if not self.binary[column]:
            return ["" if v is None else v for v in values]
        try:
            return ["" if v is None else v.decode("utf-8") for v in values]
        except UnicodeDecodeError:
            bad = next(i for i, v in enumerate(values) if v is not None and not _is_utf8(v))
            raise DataError(
                f"{self.where}: column {column!r}, record {first + bad + 1}: bytes that are not "
                "UTF-8; re-encode the corpus as UTF-8"
            ) from None

    def _key_error(self) -> DataError:
        return DataError(
            f"{self.where}: 'translation' entries lack {self.src_lang!r}/{self.tgt_lang!r} keys; "
            "check data.src_lang and data.tgt_lang"
        )

    def _compute_fingerprint(self) -> str:
        identity = self.content or self.table._fingerprint
        return hashlib.sha256(f"{identity}/{self.src_lang}/{self.tgt_lang}".encode()).hexdigest()[:16]

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        first = 0
        src_col, tgt_col = self.columns or (f"translation.{self.src_lang}", f"translation.{self.tgt_lang}")
        for batch in self.table.data.to_batches(max_chunksize=size):
            try:
                src = self._column(batch, src_col).to_pylist()
                tgt = self._column(batch, tgt_col).to_pylist()
            except KeyError:
                raise self._key_error() from None
            yield self._text(src, src_col, first), self._text(tgt, tgt_col, first)
            first += len(batch)

    @staticmethod
    def _column(batch, column: str):
        """A column of a record batch: `de`, or a field of a struct column, `translation.de`."""
        name, _, field = column.partition(".")
        values = batch.column(batch.schema.get_field_index(name))
        return values.field(field) if field else values


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class InMemory(SplitSource):
    """Lines already in memory (the embedded corpus, tests)."""

    def __init__(self, src: list[str], tgt: list[str], where: str):
        if len(src) != len(tgt):
            raise DataError(f"{where}: {len(src)} source lines but {len(tgt)} target lines")
        self.src, self.tgt, self.where = src, tgt, where

    def _compute_fingerprint(self) -> str:
        digest = hashlib.sha256()
        for lines in (self.src, self.tgt):
            digest.update("\n".join(lines).encode("utf-8", "surrogatepass"))
            digest.update(b"\0")
        return digest.hexdigest()[:16]

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        for start in range(0, len(self.src), size):
            yield self.src[start : start + size], self.tgt[start : start + size]


class Concatenated(SplitSource):
    """Several sources read one after the other (the corpora of a mixture, for their joint tokenizer)."""

    def __init__(self, sources: list[SplitSource]):
        self.sources = sources
        self.where = " + ".join(source.where for source in sources)

    def _compute_fingerprint(self) -> str:
        joined = "\0".join(source.fingerprint() for source in self.sources)
        return hashlib.sha256(joined.encode()).hexdigest()[:16]

    def chunks(self, size: int = CHUNK_LINES) -> Iterator[Chunk]:
        for source in self.sources:
            yield from source.chunks(size)


def keyed_by_language(source: SplitSource, src_lang: str, tgt_lang: str) -> bool:
    """Whether `source` holds text picked by its languages (files `val.fr`, a `translation` column, columns
    named fr and en): a TSV holds one pair, whatever the languages asked for."""
    if isinstance(source, ParallelFiles):
        return True
    return isinstance(source, ArrowTable) and source.columns in (None, (src_lang, tgt_lang))


def _memo_dir(cfg: DataConfig) -> Path:
    """data.cache_dir/fingerprints/: the content hashes of local files, by their identity (`hash_files`)."""
    return Path(cfg.cache_dir) / "fingerprints"


def open_split(cfg: DataConfig, split: str, key: str = "data") -> SplitSource:
    """The source of one split ("train", "validation" or "test" in config terms). `key`: what errors call
    the config's section (`data.path=...`; a corpus of a mixture: `data.corpora[1].path=...`)."""
    split_key = {"train": cfg.train_split, "validation": cfg.valid_split, "test": cfg.test_split}.get(split, split)
    if cfg.path:
        if split != "train" and Path(cfg.path).expanduser().is_file():
            raise DataError(
                f"{key}.path={cfg.path}: one file is a training split only (the {split} split would be "
                f"the training data itself, and best.pt chosen on it); point {key}.path at a directory "
                f"holding train.* and {split_key}.* files (data.local_splits names other stems)"
            )
        source = _open_local(cfg, split_key, key)
        source.memo = _memo_dir(cfg)
        return source
    if cfg.hub_id:
        return _open_hub(cfg, split_key, key)
    pairs = toy.generate(cfg.embedded_pairs)
    canonical = {cfg.train_split: "train", cfg.valid_split: "validation", cfg.test_split: "test"}
    if canonical.get(split_key) not in pairs:
        raise DataError(f"the embedded corpus has splits train, validation, test; not {split_key!r}")
    return InMemory(*pairs[canonical[split_key]], where=f"the embedded corpus ({split_key})")


def load_split_text(cfg: DataConfig, split: str) -> Chunk:
    """Source and target lines of one split, whole (for the splits that are decoded and scored)."""
    return open_split(cfg, split).read_all()


def _open_local(cfg: DataConfig, split: str, key: str) -> SplitSource:
    root = Path(cfg.path).expanduser()
    if not root.exists():
        raise DataError(f"{key}.path={cfg.path}: {dangling_link(root) or 'no such file or directory'}")
    name = cfg.split_name(split)
    kind = not_regular(root)
    if kind not in (None, "a directory"):
        raise DataError(
            f"{key}.path={cfg.path}: is not a regular file or a directory (it is {kind}); "
            "point it at the directory of your corpus files"
        )
    if root.is_file():
        if root.suffix not in (".tsv", ".jsonl", ".json", ".parquet"):
            raise DataError(
                f"{key}.path={cfg.path}: one file must be .tsv, .jsonl or .parquet, holding both sides; "
                f"plain text comes as two files ({name}.{cfg.src_lang} + {name}.{cfg.tgt_lang}): point "
                f"{key}.path at their directory"
            )
        candidates = [root]
    else:
        src_file, tgt_file = root / f"{name}.{cfg.src_lang}", root / f"{name}.{cfg.tgt_lang}"
        if src_file.exists() or tgt_file.exists():
            return ParallelFiles(src_file, tgt_file)
        candidates = [root / f"{name}.{ext}" for ext in ("tsv", "jsonl", "json", "parquet")]
    for file in candidates:
        if not file.exists():
            continue
        refuse_irregular(file)
        if file.suffix == ".tsv":
            return TsvFile(file, cfg.src_lang, cfg.tgt_lang)
        builder = "parquet" if file.suffix == ".parquet" else "json"
        datasets = _datasets(str(file))
        # datasets keys its Arrow copy of a local file by path and modification time: a file rewritten
        # with its old time (cp -p, rsync -a, touch -r) came back as the old rows. Keyed by content here.
        content = hash_files(file, memo=_memo_dir(cfg))
        try:
            table = datasets.load_dataset(
                builder,
                data_files=str(file),
                split="train",
                cache_dir=str(Path(datasets.config.HF_DATASETS_CACHE) / "by-content" / content),
            )
        except Exception as error:  # datasets raises many types for malformed files
            raise DataError(f"{file}: cannot be read as {builder}: {error}") from None
        return ArrowTable(table, cfg, str(file), content=content)
    raise DataError(
        f"{key}.path={cfg.path}: no files for split {split!r}; expected {name}.{cfg.src_lang} + "
        f"{name}.{cfg.tgt_lang}, or {name}.tsv / {name}.jsonl / {name}.parquet"
    )


def _open_hub(cfg: DataConfig, split: str, key: str) -> SplitSource:
    from transformer.data.hub import cache_only_without_network

    datasets = _datasets(f"{key}.hub_id={cfg.hub_id}")
    offline = cache_only_without_network()
    try:
        table = datasets.load_dataset(cfg.hub_id, cfg.hub_config, split=split)
    except Exception as error:  # offline, unknown id, unknown split: all surface as different types
        reason = offline or f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise DataError(
            f"{key}.hub_id={cfg.hub_id}: cannot load split {split!r} from the HuggingFace hub ({reason}). "
            f"Without network access use local files: {key}.path=DIR"
        ) from None
    return ArrowTable(table, cfg, f"hub dataset {cfg.hub_id} ({split})")
