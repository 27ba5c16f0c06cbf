"""A Vaswani-style Transformer translation trainer: Hydra configs, SentencePiece, AMP, beam search."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import transformer.data.sources` should not pay for loading the model code, and vice versa.
    if name == "Translator":
        from transformer.inference.translator import Translator

        return Translator
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")


__all__ = ["Translator"]
