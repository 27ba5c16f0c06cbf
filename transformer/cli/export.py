"""`transformer-export CKPT --format safetensors|transformers|ctranslate2 OUT`: a checkpoint as a model directory."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from transformer.cli.args import CommandLineParser
from transformer.cli.run import run_command
from transformer.errors import (
    UsageError,
    import_torch_holding_interrupts,
)
from transformer.inference.ctranslate2 import CT2_QUANTIZATIONS, export_ctranslate2
from transformer.inference.hf_export import export_transformers
from transformer.inference.model_directory import check_output_directory, failure_reason, output_directory
from transformer.inference.pretrained import save_pretrained
from transformer.inference.test_results import test_results_for

if TYPE_CHECKING:
    pass


FORMATS = ("safetensors", "transformers", "ctranslate2")
DEPRECATED_FORMATS = {"hf": "safetensors"}  # --format hf: the safetensors directory's first name


def main(argv: list[str] | None = None) -> int:
    parser = CommandLineParser(  # errors in one line, as transformer-translate's
        prog="transformer-export",
        description="Write a checkpoint as a shareable safetensors directory, a HuggingFace transformers model "
        "or a CTranslate2 model.",
    )
    parser.add_argument("checkpoint", help="a .pt checkpoint written by training (best.pt, avg.pt, ...)")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument(
        "--format",
        required=True,
        choices=[*FORMATS, *DEPRECATED_FORMATS],
        help="safetensors: model.safetensors + config.json + SentencePiece + a model card "
        "(README.md), loaded by Translator.from_pretrained and transformer-translate (hf is its old "
        "name); transformers: a native HuggingFace transformers model (Marian for post-norm, Pegasus "
        "for pre-norm) that AutoModelForSeq2SeqLM and AutoTokenizer load, with a model card (needs "
        "the transformers package); ctranslate2: for the CTranslate2 engine",
    )
    parser.add_argument(
        "--quantization",
        choices=CT2_QUANTIZATIONS,
        help="with --format ctranslate2: weight type (default: float32 as trained)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a previous export in the output directory (refused if it holds anything else)",
    )
    args = parser.parse_args(argv)
    if args.quantization and DEPRECATED_FORMATS.get(args.format, args.format) != "ctranslate2":
        parser.error("--quantization applies to --format ctranslate2 only")
    # Ctrl-C: the staging directory is removed, a previous export kept
    return run_command("transformer-export", lambda: _export(args), interrupted="interrupted; nothing was exported")


def _export(args) -> int:
    requested, export_format = args.format, DEPRECATED_FORMATS.get(args.format, args.format)
    try:
        check_output_directory(output_directory(args.output), args.force)  # before reading the checkpoint
        import_torch_holding_interrupts()
        from transformer.checkpoint import load_checkpoint, model_from_checkpoint

        state = load_checkpoint(args.checkpoint)
        model, tokenizer, config = model_from_checkpoint(state, args.checkpoint)
        trained = {"step": state.get("step"), "metrics": state.get("metrics")}
        trained["test"] = test_results_for(args.checkpoint, state.get("step"))  # the run's test_results.json
        if export_format == "safetensors":
            out = save_pretrained(model, tokenizer, config, args.output, overwrite=args.force, trained=trained)
        elif export_format == "transformers":
            out = export_transformers(model, tokenizer, config, args.output, overwrite=args.force, trained=trained)
        else:
            out = export_ctranslate2(
                model, tokenizer, args.output, args.quantization, args.force, config.data.language_tag
            )
    except (FileExistsError, ValueError) as error:
        raise UsageError(str(error)) from None
    except OSError as error:  # e.g. the output directory cannot be listed
        raise UsageError(f"{error.filename or args.output}: {failure_reason(error)}") from None
    if requested != export_format:
        print(
            f"transformer-export: warning: --format {requested} is deprecated (the directory is this package's "
            f"format, not a HuggingFace transformers model): use --format {export_format}, which writes the same "
            "files",
            file=sys.stderr,
        )
    print(f"wrote {out} ({export_format}{', ' + args.quantization if args.quantization else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
