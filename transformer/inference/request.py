"""One decoding request: what a caller (the Python API, transformer-translate, transformer-evaluate,
validation) asks of the translator, as one object that travels down to search. No torch here: the commands
build it before the model loads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformer.inference.sampling import Sampling

# The keys of the config's decode section a request may set (DecodeConfig, DECODE_OPTIONS).
SEARCH_KEYS = ("beam_size", "alpha", "nbest", "max_len_a", "max_len_b", "batch_tokens")


@dataclass(frozen=True)
class DecodeRequest:
    """The decode section's options a caller sets (None: the model's decode section, else the schema's
    default: `DecodeConfig.for_translation`), `sampling` instead of a search (one drawn translation per
    sentence), `prefixes` (one target-language prefix per sentence, '' for none, that each translation
    starts with), `tgt_lang` (the target language of a multilingual model), `workers` (CPU processes
    decoding batches at a time, one core each; None: one per core) and `use_cache` (False recomputes every
    prefix: the bench's reference)."""

    beam_size: int | None = None
    alpha: float | None = None
    nbest: int | None = None
    max_len_a: float | None = None
    max_len_b: int | None = None
    batch_tokens: int | None = None
    sampling: Sampling | None = None
    prefixes: Sequence[str] | None = None
    tgt_lang: str | None = None
    workers: int | None = None
    use_cache: bool = True

    def search_options(self) -> dict[str, Any]:
        """The decode section's keys as given (None where left out)."""
        return {key: getattr(self, key) for key in SEARCH_KEYS}
