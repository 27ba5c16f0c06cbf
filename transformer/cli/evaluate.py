"""`make evaluate CKPT=... [split=test]`, `transformer-evaluate`: translate a split (or a source/reference
file pair), print sacreBLEU and chrF with their signatures (`scoring.score`: hypotheses and references in Unicode NFC,
`|norm:nfc`), and write the hypotheses and a JSON of scores beside the checkpoint (the first one of an
ensemble). For a multilingual model, also the share of translations in another of its languages
(off-target rate, transformer/data/langid.py). `--alpha 1,1.5,2` scores each length penalty and names the
best; `--directions all` scores every direction of a multilingual model (with an alpha list: the best
per target language, `decode.alpha_by_language`). `--augment upper,title,typos,nopunct,mix` scores noised copies
of the set (data/augment.py) beside the clean score. Like transformer-translate, it answers --help and
refuses bad arguments before it loads torch."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from transformer.cli.args import (
    CommandLineParser,
    add_decoding_flags,
    add_model_arguments,
    checked_model_arguments,
    device_error,
    given_decoding_options,
)
from transformer.cli.evaluate_report import (
    alpha_text,
    print_augmented,
    print_directions,
    print_result,
    print_search,
    search_line,
)
from transformer.cli.run import run_command
from transformer.config import check_decode_options
from transformer.data.augment import EVALUATION_SEED, EVALUATION_TYPO_RATE, VARIANTS, variant_names
from transformer.errors import UsageError
from transformer.inference.evaluate import EvaluationSet, Models, evaluate
from transformer.inference.request import DecodeRequest


def build_parser() -> CommandLineParser:
    parser = CommandLineParser(prog="transformer-evaluate", description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--split", default="test", help="split of the checkpoint's data config (default test)")
    parser.add_argument("--src", help="source file (instead of --split)")
    parser.add_argument("--ref", help="reference file (instead of --split)")
    parser.add_argument(
        "--src-lang",
        metavar="LANG",
        help="a multilingual model: the source language of the "
        "split's files to translate (default: the checkpoint's data.src_lang)",
    )
    parser.add_argument(
        "--tgt-lang",
        metavar="LANG",
        help="a multilingual model: the target language to translate "
        "into and score (default: the checkpoint's data.tgt_lang; needed with --src)",
    )
    parser.add_argument(
        "--directions",
        metavar="all|SRC-TGT[,...]",
        help="a multilingual model: score several "
        "directions of the split, each as --src-lang/--tgt-lang would (all: every direction it "
        "trained), then their mean",
    )
    parser.add_argument(
        "--tokenized-lc",
        metavar="REF",
        help="the same references lowercased and Moses-tokenized "
        "(Multi30k's tok/*.lc.norm.tok.*): also report BLEU as the literature does, our output "
        "lowercased, normalized and tokenized the same way (sacremoses), sacreBLEU tokenize=none; "
        "with --directions, {tgt} in REF stands for each target language",
    )
    parser.add_argument(
        "--augment",
        metavar="VARIANT[,...]",
        type=augment_variants,
        help="also score noised copies of the set, one row each beside the clean score: "
        f"{', '.join(VARIANTS)} (upper: source and reference in upper case; title: each word's first letter "
        f"in upper case, both sides; typos: in {EVALUATION_TYPO_RATE:.0%} of the source's words longer than "
        "three letters, the reference kept; nopunct: the source's final punctuation removed, and then the "
        "reference's; mix: one of these drawn per sentence). Each copy's sources, references and "
        "hypotheses are written beside the checkpoint (<ckpt>.<split>.aug-VARIANT.beamN.src/.ref/.hyp)".replace(
            "%", "%%"
        ),
    )
    parser.add_argument(
        "--pivot",
        metavar="LANG",
        help="a multilingual model: also translate through LANG (source -> LANG -> target, the same model) "
        "and score that beside the direct translation, with the off-target rate of both (e.g. a zero-shot "
        "direction against the pivot through English: --src-lang de --tgt-lang fr --pivot en)",
    )
    parser.add_argument(
        "--augment-seed",
        type=int,
        metavar="N",
        help=f"the seed of the --augment copies (default {EVALUATION_SEED}): the same seed, the same copies",
    )
    add_decoding_flags(parser, leave_out=("nbest",))  # it scores the best translation of each line
    for action in parser._actions:  # --alpha: one value, or a search over several
        if action.dest == "alpha":
            action.type = alpha_values
            action.metavar = "A[,A...]|LANG=A[,...]"
            action.help += (
                "; several values separated by commas score the split once with each and name the "
                "best (a length penalty search: run it on --split validation); LANG=A pairs "
                "(en=2,de=1.5) give each target language its own, as decode.alpha_by_language "
                "does"
            ).replace("%", "%%")
    return parser


def alpha_values(text: str) -> list[float] | dict[str, float]:
    """--alpha 2 or --alpha 1,1.5,2: the values to score with; --alpha en=2,de=1.5: one per target
    language (each value is checked as --alpha is, in `main`)."""
    parts = [part.strip() for part in text.split(",")]
    by_language = ["=" in part for part in parts]
    try:
        if any(by_language):
            if not all(by_language):
                raise ValueError
            pairs = [part.split("=", 1) for part in parts]
            if not all(language.strip() for language, _ in pairs):
                raise ValueError
            languages = [language.strip() for language, _ in pairs]
            if len(set(languages)) != len(languages):
                raise argparse.ArgumentTypeError(f"{text!r}: a language is given twice")
            return {language: float(value) for language, (_, value) in zip(languages, pairs)}
        values = [float(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number, numbers separated by commas (1,1.5,2), or one per target language (en=2,de=1.5)"
        ) from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: a value is given twice")
    return values


def augment_variants(text: str) -> list[str]:
    """--augment upper,title: the variants' names (data/augment.py), each known and given once."""
    try:
        return variant_names(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("transformer-evaluate", lambda: _evaluate(args))


def _evaluate(args) -> int:
    """Check the command line, load the model(s) once where several evaluations share them, evaluate
    each (alpha, direction), report."""
    try:
        alphas, per_language = _check(args)
        translator, directions = _load(args, alphas, per_language)
        results = _run(args, translator, directions, alphas, per_language)
    except ValueError as error:  # a bad value the library names (ConfigError and DataError are ValueErrors)
        raise UsageError(str(error)) from None
    except OSError as error:  # e.g. the hypothesis file cannot be written beside the checkpoint
        raise UsageError(f"{error.filename}: {error.strerror}") from None
    if args.directions:
        print_directions(results, len(alphas) > 1, show_alpha=per_language is not None)
    elif args.augment:
        print_augmented(results)
    elif len(results) > 1:
        print_search(results, args)
    else:
        print_result(results[0])
    return 0


def _check(args) -> tuple[list, dict[str, float] | None]:
    """Refused before the model is loaded: the decoding options (each alpha of a search), --directions
    with flags that choose one direction. Returns the alphas to score and the per-language ones."""
    per_language = args.alpha if isinstance(args.alpha, dict) else None  # --alpha en=2,de=1.5
    alphas = [None] if per_language is not None else args.alpha or [None]
    others = {key: value for key, value in given_decoding_options(args).items() if key != "alpha"}
    for alpha in alphas:
        check_decode_options({**others, **({} if alpha is None else {"alpha": alpha})}, "cli")
    for language, alpha in (per_language or {}).items():
        try:
            check_decode_options({**others, "alpha": alpha}, "cli")
        except ValueError as error:  # "--alpha -1.0: must be ...", named with its language
            raise ValueError(f"--alpha {language}={alpha:g}: {str(error).split(': ', 1)[1]}") from None
    _refuse_greedy(args.beam, alphas, per_language)
    if args.directions and (args.src_lang or args.tgt_lang or args.src or args.ref):
        raise ValueError(
            "--directions scores the split in each direction: leave out --src-lang, --tgt-lang, --src and --ref"
        )
    _check_augment(args, alphas)
    if args.pivot and (args.augment or len(alphas) > 1):
        raise ValueError("--pivot scores one translation beside its pivot: leave out --augment and give one --alpha")
    args.weights = checked_model_arguments(args)
    bad_device = device_error(args.device)
    if bad_device:
        raise ValueError(bad_device)
    return alphas, per_language


def _load(args, alphas: list, per_language: dict[str, float] | None):
    """The model(s), loaded here when several evaluations share them (else by each evaluation), and the
    directions to score, checked against them."""
    translator = None
    if len(alphas) > 1 or args.directions or per_language is not None or args.augment:  # loaded once for all below
        from transformer.inference.translator import Translator

        translator = Translator.from_checkpoints(
            args.checkpoints, args.weights, device=args.device, precision=args.precision, quantize=args.quantize
        )
    directions = _directions(args.directions, translator) if args.directions else [(args.src_lang, args.tgt_lang)]
    if translator is not None:  # a checkpoint that decodes greedily unless told otherwise
        _refuse_greedy(translator.config.decode.beam_size if args.beam is None else args.beam, alphas, per_language)
    if per_language is not None:
        _check_alpha_languages(per_language, translator, {tgt for _, tgt in directions})
    if (
        args.directions
        and args.tokenized_lc
        and "{tgt}" not in args.tokenized_lc
        and len({t for _, t in directions}) > 1
    ):
        raise ValueError(
            f"--tokenized-lc {args.tokenized_lc}: the directions have several target languages; "
            "write {tgt} where the language goes in the file name (test.lc.norm.tok.{tgt})"
        )
    return translator, directions


def _run(args, translator, directions, alphas: list, per_language: dict[str, float] | None) -> list[dict]:
    """One evaluation per direction and alpha; a search's line printed as each ends."""
    models = Models(tuple(args.checkpoints), args.weights, args.device, args.precision, args.quantize)
    results = []
    for src_lang, tgt_lang in directions:
        if per_language is not None:  # the language's own, else the model's default for it
            alphas = [per_language.get(_scored_language(tgt_lang, translator))]
        tokenized_lc = args.tokenized_lc
        if tokenized_lc and tgt_lang:
            tokenized_lc = tokenized_lc.replace("{tgt}", tgt_lang)
        data = EvaluationSet(args.split, args.src, args.ref, src_lang, tokenized_lc, pivot=args.pivot)
        for alpha in alphas:
            request = DecodeRequest(
                beam_size=args.beam,
                alpha=alpha,
                max_len_a=args.max_len_a,
                max_len_b=args.max_len_b,
                batch_tokens=args.batch_tokens,
                tgt_lang=tgt_lang,
                workers=args.workers,
            )
            label = f"alpha{alpha:g}" if len(alphas) > 1 else None
            results.append(evaluate(models, data, request, label=label, translator=translator))
            for name in args.augment or ():  # the noised copies, translated and scored as the clean set is
                noised = dataclasses.replace(data, augment=name, augment_seed=args.augment_seed)
                results.append(evaluate(models, noised, request, label=label, translator=translator))
            if len(alphas) > 1 or args.directions:
                line = search_line(results[-1], bool(args.directions), len(alphas) > 1 or per_language is not None)
                print(line, flush=True)
    return results


def _check_augment(args, alphas: list) -> None:
    """--augment: one evaluation (a direction, an alpha) and its noised copies; --augment-seed with it."""
    if args.augment_seed is None:
        args.augment_seed = EVALUATION_SEED
    elif not args.augment:
        raise ValueError(f"--augment-seed {args.augment_seed}: it seeds the noised copies; give --augment too")
    elif args.augment_seed < 0:
        raise ValueError(f"--augment-seed {args.augment_seed}: give a whole number of 0 or more")
    if not args.augment:
        return
    if args.directions or len(alphas) > 1:
        raise ValueError(
            "--augment scores one evaluation beside its noised copies: leave out --directions and give one --alpha"
        )
    if args.tokenized_lc:
        raise ValueError("--augment: leave out --tokenized-lc (the noised copies have no tokenized references)")


def _refuse_greedy(beam: int | None, alphas: list, per_language: dict[str, float] | None) -> None:
    """A length penalty search or one per language with a beam of 1: greedy search has none."""
    if beam != 1:
        return
    if len(alphas) > 1:
        raise ValueError(
            f"--alpha {','.join(f'{a:g}' for a in alphas)}: a length penalty search needs a beam "
            "of 2 or more (--beam 5): greedy search has no length penalty"
        )
    if per_language is not None:
        raise ValueError(
            f"--alpha {alpha_text(per_language)}: a length penalty per language needs a beam of 2 "
            "or more (--beam 5): greedy search has no length penalty"
        )


def _scored_language(tgt_lang: str | None, translator) -> str:
    """The language a direction is scored in: --tgt-lang, else the checkpoint's (as `evaluate` does)."""
    return tgt_lang or translator.config.data.tgt_lang


def _check_alpha_languages(per_language: dict[str, float], translator, targets: set[str | None]) -> None:
    """--alpha LANG=A: each LANG is a language the model translates into; one that no direction scored
    here translates into is said (a typo, or the wrong direction)."""
    known = translator.target_languages or [translator.config.data.tgt_lang]
    unknown = [language for language in per_language if language not in known]
    if unknown:
        raise ValueError(
            f"--alpha {alpha_text(per_language)}: the model does not translate into {unknown[0]}; "
            f"it translates into {', '.join(known)}"
        )
    scored = {_scored_language(target, translator) for target in targets}
    unused = [language for language in per_language if language not in scored]
    if unused:
        print(
            f"note: --alpha {alpha_text({lang: per_language[lang] for lang in unused})}: no direction "
            f"scored here translates into {' or '.join(unused)}",
            file=sys.stderr,
        )


def _directions(given: str, translator) -> list[tuple[str, str]]:
    """--directions all (every direction the model trained) or de-en,en-fr: (source, target) pairs, each
    checked by `evaluate` as --src-lang/--tgt-lang are."""
    if given == "all":
        return translator.config.data.directions()
    pairs = [part.strip().split("-") for part in given.split(",")]
    bad = [part for part, pair in zip(given.split(","), pairs) if len(pair) != 2 or not all(pair)]
    if bad:
        raise ValueError(
            f"--directions {given}: {bad[0].strip()!r} is not SRC-TGT; give all, or pairs such as de-en,en-fr"
        )
    pairs = [(src, tgt) for src, tgt in pairs]
    twice = next((pair for i, pair in enumerate(pairs) if pair in pairs[:i]), None)
    if twice:  # it would count twice in the mean
        raise ValueError(f"--directions {given}: {'-'.join(twice)} is given twice; give each direction once")
    data = translator.config.data
    trained = ", ".join(f"{src}-{tgt}" for src, tgt in data.directions())
    multilingual = bool(data.target_languages())
    for src, tgt in pairs:
        if not multilingual and (src, tgt) != (data.src_lang, data.tgt_lang):
            raise ValueError(
                f"--directions {given}: this model translates {data.src_lang} -> {data.tgt_lang} only; "
                f"give --directions {data.src_lang}-{data.tgt_lang} or leave it out"
            )
        if multilingual and (src not in data.languages() or tgt not in data.target_languages()):
            raise ValueError(
                f"--directions {given}: {src}-{tgt} is not among the languages the model was trained on "
                f"(its directions: {trained}); give all, or directions between its languages"
            )
    return pairs


if __name__ == "__main__":
    sys.exit(main())
