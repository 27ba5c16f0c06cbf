"""The zero-shot directions of a multilingual run that its data can validate (`data.validate_zero_shot`):
pairs of its languages it never trains, for which data.path (or data.hub_id) holds text in both languages.
Multi30k is four-way parallel, so `val.de` and `val.fr` are a validation split of de -> fr even though only
de <-> en and fr <-> en are trained."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from transformer.config import DataConfig
from transformer.data.sources import keyed_by_language, open_split
from transformer.errors import DataError

log = logging.getLogger(__name__)


def zero_shot_directions(cfg: DataConfig) -> list[tuple[str, str]]:
    """(source, target) pairs of the run's languages into one of its target languages that no corpus trains."""
    trained = set(cfg.directions())
    return [
        (src, tgt)
        for src in cfg.languages()
        for tgt in cfg.target_languages()
        if src != tgt and (src, tgt) not in trained
    ]


def zero_shot_validation(cfg: DataConfig, encode: Callable) -> dict[str, tuple]:
    """{"de-fr": (encoded validation split, its text)} for each zero-shot direction whose two languages
    data.path / data.hub_id has validation text in (`encode(config, source, "validation")` prepares one);
    the others are named in one log line."""
    found, missing = {}, []
    for src, tgt in zero_shot_directions(cfg):
        own = dataclasses.replace(cfg, name=f"{cfg.name}_{src}_{tgt}", src_lang=src, tgt_lang=tgt, corpora=[])
        try:
            source = open_split(own, "validation")
        except DataError:
            missing.append(f"{src}-{tgt}")
            continue
        if not keyed_by_language(source, src, tgt):
            missing.append(f"{src}-{tgt}")
            continue
        found[f"{src}-{tgt}"] = (encode(own, source, "validation"), source)
    if missing:
        log.info("data.validate_zero_shot: no validation text in data.path / data.hub_id for %s", ", ".join(missing))
    return found
