"""DataError, in a leaf module: what only raises it (batching, the caches, the tokenizer) imports it from
here, so that translating does not load the corpus readers of `transformer.data` (which re-exports it)."""


class DataError(ValueError):
    """Input data cannot be used; the message names the file (and line) or the config key."""
