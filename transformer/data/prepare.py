"""What a run trains on: the tokenizer and the encoded splits of one corpus, or of a mixture of corpora
(`data.corpora`). Above both corpus.py and mixture.py, so that neither needs the other's dispatch."""

from __future__ import annotations

import logging

from transformer.config import DataConfig
from transformer.data.corpus import EncodedCorpus, PreparedData, encoded_split, preparation_lock, train_tokenizer
from transformer.data.mixture import prepare_mixture
from transformer.data.overlap import warn_of_overlap
from transformer.data.sources import SplitSource, open_split
from transformer.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def prepare(
    cfg: DataConfig,
    tokenizer: Tokenizer | None = None,
    splits=("train", "validation"),
    sources: dict[str, SplitSource] | None = None,
) -> PreparedData:
    """Tokenizer (trained on the training split unless given) and the encoded `splits` (or `sources`,
    already opened). With data.corpora, the mixture of those corpora (`mixture.prepare_mixture`).

    Everything cached and whole: read without the lock (every rank at once). Something missing or
    damaged: take the lock and build what is still missing or damaged once it is held.
    """
    if cfg.corpora:
        return prepare_mixture(cfg, tokenizer, splits, sources)
    sources = sources or {split: open_split(cfg, split) for split in splits}
    for source in sources.values():
        source.fingerprint()  # hashed outside the lock, once per process
    checked: dict[tuple[str, str], EncodedCorpus] = {}  # (split, tokenizer): checked once per process

    def collect(build: bool) -> dict | None:
        tok = tokenizer or train_tokenizer(cfg, sources["train"], build=build)
        if tok is None:
            return None
        found = {"tokenizer": tok}
        for split, source in sources.items():
            key = (split, tok.fingerprint())
            if key not in checked:
                corpus = encoded_split(source, tok, cfg, split, build=build)
                if corpus is None:
                    return None
                checked[key] = corpus
            found[split] = checked[key]
        return found

    encoded = collect(build=False)
    if encoded is None:
        with preparation_lock(cfg):
            encoded = collect(build=True)
    tokenizer = encoded["tokenizer"]
    for split in ("train", "validation"):  # the test split is scored from its text: no filter report
        if split in encoded:
            encoded[split].report()
    if "validation" in encoded:
        warn_of_overlap([encoded["train"]], encoded["train"].identity, encoded["validation"], "validation")
    log.info(
        "data %s: %d training pairs%s",
        cfg.name,
        len(encoded["train"]),
        f", {len(encoded['validation'])} validation pairs" if "validation" in encoded else "",
    )
    return PreparedData(tokenizer, encoded["train"], encoded.get("validation"), sources)
