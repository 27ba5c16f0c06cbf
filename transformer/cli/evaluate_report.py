"""What `transformer-evaluate` prints (cli/evaluate.py runs the evaluations): one result, the lines and the
choice of a length penalty search, the table of several directions, and the table of noised copies
(`--augment`) beside the clean score."""

from __future__ import annotations

import sys

from transformer.data.augment import EVALUATION_TYPO_RATE


def print_result(result: dict) -> None:
    if "ensemble" in result:
        print(f"ensemble of {len(result['ensemble'])}: {' '.join(result['ensemble'])}")
    print(
        f"{result['split']}: BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  "
        f"({result['sentences']} sentences, beam {result['beam_size']}, {result['seconds']:.1f} s)"
    )
    print(f"BLEU signature: {result['bleu_signature']}")
    if "bleu_tokenized_lc" in result:
        print(
            f"BLEU tokenized and lowercased, as the literature reports it (not comparable with the above): "
            f"{result['bleu_tokenized_lc']:.2f}  {result['bleu_tokenized_lc_signature']}"
        )
    print(f"chrF signature: {result['chrf_signature']}")
    if "off_target" in result:
        wrong = ", ".join(f"{lang} {count}" for lang, count in result["off_target_languages"].items())
        print(
            f"off-target: {result['off_target']:.2f}% of the translations are in another of the model's languages "
            f"({wrong or 'none'}; py3langid choosing among {', '.join(result['off_target_among'])})"
        )
    if "pivot" in result:
        print(pivot_line(result))
    print(f"hypotheses: {result['hypotheses_file']}\nscores: {result['scores_file']}")


def pivot_line(result: dict) -> str:
    """The pivot translation (--pivot) beside the direct one: BLEU, chrF, the difference, the off-target rates."""
    pivot = result["pivot"]
    off = (
        f"; off-target {pivot['off_target']:.2f}% (direct {result['off_target']:.2f}%, the step into "
        f"{pivot['via']} {pivot['off_target_into_pivot']:.2f}%)"
        if "off_target" in pivot and "off_target" in result
        else ""
    )
    return (
        f"through {pivot['via']}: BLEU {pivot['bleu']:.2f}  chrF {pivot['chrf']:.2f}  (direct - pivot: BLEU "
        f"{result['bleu'] - pivot['bleu']:+.2f}){off}  ({pivot['seconds']:.1f} s; {pivot['hypotheses_file']})"
    )


def alpha_text(per_language: dict[str, float]) -> str:
    return ",".join(f"{language}={alpha:g}" for language, alpha in per_language.items())


def search_line(result: dict, direction: bool = False, alpha: bool = True) -> str:
    """One evaluation of a search or of several directions, in one line."""
    tokenized = f"  tokenized lowercased {result['bleu_tokenized_lc']:.2f}" if "bleu_tokenized_lc" in result else ""
    off = f"  off-target {result['off_target']:.2f}%" if "off_target" in result else ""
    what = " ".join(
        ([f"{result['src_lang']}-{result['tgt_lang']}"] if direction else [])
        + ([f"alpha {result['alpha']:g}"] if alpha else [])
    )
    through = ""
    if "pivot" in result:
        pivot = result["pivot"]
        pivot_off = f", off-target {pivot['off_target']:.2f}%" if "off_target" in pivot else ""
        through = f"  through {pivot['via']}: BLEU {pivot['bleu']:.2f}{pivot_off}"
    return (
        f"{what}: BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}{tokenized}{off}{through}  "
        f"({result['seconds']:.1f} s)"
    )


def print_directions(results: list[dict], searched: bool, show_alpha: bool = False) -> None:
    """Several directions: with a search, the best alpha of each target language (the mean BLEU of the
    directions into it) and the setting that makes them the model's defaults; then each direction's
    result (at its language's best alpha) and their mean."""

    def direction(result):
        return f"{result['src_lang']}-{result['tgt_lang']}"

    chosen = results
    if searched:
        by_language: dict[str, dict[float, list[float]]] = {}
        for result in results:
            by_language.setdefault(result["tgt_lang"], {}).setdefault(result["alpha"], []).append(result["bleu"])
        best = {
            language: max(scores, key=lambda a: sum(scores[a]) / len(scores[a]))
            for language, scores in by_language.items()
        }
        for language, alpha in sorted(best.items()):
            means = ", ".join(f"{a:g}: {sum(v) / len(v):.2f}" for a, v in by_language[language].items())
            print(f"into {language}: alpha {alpha:g} (mean BLEU of the directions into it at each alpha: {means})")
        print(
            "as the model's defaults: decode.alpha_by_language='{"
            + ", ".join(f"{language}: {alpha:g}" for language, alpha in sorted(best.items()))
            + "}' at training; "
            f"for this model: --alpha {alpha_text(dict(sorted(best.items())))}"
        )
        chosen = [r for r in results if r["alpha"] == best[r["tgt_lang"]]]
    show_alpha = show_alpha or searched
    pivoted = "pivot" in chosen[0]
    print(
        f"{'direction':10} {'BLEU':>6} {'chrF':>6}"
        + ("  alpha" if show_alpha else "")
        + (f" {'off-target':>10} {'pivot ' + chosen[0]['pivot']['via']:>8} {'off-target':>10}" if pivoted else "")
    )
    for result in chosen:
        print(
            f"{direction(result):10} {result['bleu']:6.2f} {result['chrf']:6.2f}"
            + (f"  {result['alpha']:g}" if show_alpha else "")
            + (
                f" {result.get('off_target', float('nan')):9.2f}% {result['pivot']['bleu']:8.2f} "
                f"{result['pivot'].get('off_target', float('nan')):9.2f}%"
                if pivoted
                else ""
            )
        )
    mean = sum(r["bleu"] for r in chosen) / len(chosen)
    pivot_mean = sum(r["pivot"]["bleu"] for r in chosen) / len(chosen) if pivoted else 0.0
    print(
        f"{f'mean of {len(chosen)}':10} {mean:6.2f} {sum(r['chrf'] for r in chosen) / len(chosen):6.2f}"
        + (f" {'':>10} {pivot_mean:8.2f}" if pivoted and not show_alpha else "")
    )
    if searched and chosen[0]["split"].split(".")[0] == "test":
        print(
            "note: a length penalty chosen on the test split overstates its test score; search on --split validation",
            file=sys.stderr,
        )
    print(f"BLEU signature: {chosen[0]['bleu_signature']} (each direction's in its results)")
    print(f"results: {', '.join(r['scores_file'] for r in chosen)}")


def print_search(results: list[dict], args) -> None:
    """The best alpha of a length penalty search, and where to put it."""
    best = max(results, key=lambda r: (r["bleu"], r["chrf"]))
    split = results[0]["split"].split(".alpha")[0]
    print(f"best on {split} (beam {best['beam_size']}): --alpha {best['alpha']:g} (BLEU {best['bleu']:.2f})")
    language = best["tgt_lang"]
    multilingual = "off_target_among" in best
    key = f"decode.alpha_by_language.{language}" if multilingual else "decode.alpha"
    print(
        f"as the model's default: {key}={best['alpha']:g} at training"
        + (" (the length penalty of every direction into this language)" if multilingual else "")
    )
    if args.src is None and args.split == "test":
        print(
            "note: a length penalty chosen on the test split overstates its test score; search on --split validation",
            file=sys.stderr,
        )
    print(f"BLEU signature: {best['bleu_signature']}\nresults: {', '.join(r['scores_file'] for r in results)}")


def print_augmented(results: list[dict]) -> None:
    """The clean evaluation (`results[0]`) and its noised copies (--augment): one row each with BLEU, chrF
    and the BLEU difference from the clean row; then the signatures (every row is scored alike) and the
    files."""
    clean, noised = results[0], results[1:]
    print(
        f"{clean['split']}: {clean['sentences']} sentences, beam {clean['beam_size']}; noised copies with "
        f"--augment-seed {noised[0]['augment_seed']}, typos in {EVALUATION_TYPO_RATE:.0%} of the words longer "
        "than three letters"
    )
    print(f"{'variant':9} {'BLEU':>6} {'chrF':>6} {'vs clean':>9}")
    print(f"{'clean':9} {clean['bleu']:6.2f} {clean['chrf']:6.2f}")
    for result in noised:
        print(
            f"{result['augment']:9} {result['bleu']:6.2f} {result['chrf']:6.2f} {result['bleu'] - clean['bleu']:+9.2f}"
        )
    print(f"BLEU signature: {clean['bleu_signature']}\nchrF signature: {clean['chrf_signature']}")
    print(f"hypotheses: {', '.join(result['hypotheses_file'] for result in results)}")
    print(f"scores: {', '.join(result['scores_file'] for result in results)}")
