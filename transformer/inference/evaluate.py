"""An evaluation as a library: translate a split (or a source/reference file pair) with a checkpoint or an
ensemble, score it (scoring.py) and write the hypotheses and a JSON of the scores beside the checkpoint;
the off-target rate of a multilingual model. `transformer-evaluate` (cli/evaluate.py) is its command."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformer.data.augment import EVALUATION_SEED, EVALUATION_TYPO_RATE, VARIANTS, augment_pairs
from transformer.data.lines import read_lines
from transformer.data.sources import DataError, load_split_text
from transformer.errors import overwritten_input, write_problem
from transformer.inference.request import DecodeRequest


@dataclass(frozen=True)
class Models:
    """What an evaluation loads: one checkpoint or exported model, or several (an ensemble, with optional
    `weights`), on `device` in `precision`, with `quantize` (int8) or not."""

    checkpoints: tuple[str | Path, ...]
    weights: list[float] | None = None
    device: str = "auto"
    precision: str = "auto"
    quantize: str | None = None

    @classmethod
    def of(cls, given: Models | str | Path | list | tuple) -> Models:
        """A Models from itself, a path, or a list of paths."""
        if isinstance(given, Models):
            return given
        return cls(tuple(given) if isinstance(given, (list, tuple)) else (given,))


@dataclass(frozen=True)
class EvaluationSet:
    """What an evaluation translates and scores: a split of the checkpoint's data config, or a `src_file`
    and `ref_file` pair; `src_lang`: the source language of another direction of a multilingual model (the
    target language is the decode request's `tgt_lang`); `tokenized_lc`: a file of the references lowercased
    and Moses-tokenized (Multi30k's tok/*.lc.norm.tok.*), for BLEU as the literature reports it beside ours
    (`scoring.tokenized_lowercased_bleu`); `augment`: a variant of data/augment.py (upper, title, typos, nopunct,
    mix) that noises the sources, and the references where it says so, with `augment_seed`: a noised copy of
    the set, its files named `.aug-<variant>` and holding the noised sources and references too; `pivot`: a
    multilingual model's language to translate through as well (source -> pivot -> target, the same model),
    scored beside the direct translation (`result["pivot"]`)."""

    split: str = "test"
    src_file: str | None = None
    ref_file: str | None = None
    src_lang: str | None = None
    tokenized_lc: str | None = None
    augment: str | None = None
    augment_seed: int = EVALUATION_SEED
    pivot: str | None = None


def evaluate(
    models: Models | str | Path | list,
    data: EvaluationSet = EvaluationSet(),
    request: DecodeRequest | None = None,
    *,
    label: str | None = None,
    translator=None,
) -> dict:
    """Translate `data` with `models` as `request` asks (its `tgt_lang`: another direction of a
    multilingual model, the translations into it), score them, and write the hypotheses and the scores
    beside the first checkpoint. `label`: added to the output files' names; `translator`: the models
    already loaded (a search or several directions load them once)."""
    from transformer.data.langid import off_target
    from transformer.inference.scoring import score, tokenized_lowercased_bleu
    from transformer.inference.translator import Translator

    models, request = Models.of(models), request or DecodeRequest()
    checkpoints, weights, quantize = list(models.checkpoints), models.weights, models.quantize
    checkpoint = checkpoints[0]
    augment, augment_seed, pivot = data.augment, data.augment_seed, data.pivot
    if augment is not None and augment not in VARIANTS:
        raise DataError(f"augment={augment!r} is not a variant; the variants: {', '.join(VARIANTS)}")
    if augment and data.tokenized_lc:
        raise DataError(
            "--tokenized-lc scores against clean references: leave it out of a noised (--augment) evaluation"
        )
    translator = translator or Translator.from_checkpoints(
        checkpoints, weights, device=models.device, precision=models.precision, quantize=quantize
    )
    split, src_file, ref_file, src_lang, tokenized_lc = (
        data.split,
        data.src_file,
        data.ref_file,
        data.src_lang,
        data.tokenized_lc,
    )
    tgt_lang, alpha = request.tgt_lang, request.alpha
    data = translator.config.data  # from here on: the data config of the direction scored
    known = data.languages()
    if src_lang and not data.target_languages() and src_lang != data.src_lang:
        raise DataError(
            f"--src-lang {src_lang}: this model translates {data.src_lang} -> {data.tgt_lang} only; "
            "leave --src-lang out"
        )
    if src_lang and src_lang not in known:  # its text would be tagged and translated all the same
        raise DataError(f"--src-lang {src_lang}: the model was trained on {', '.join(known)} only; give one of those")
    if src_lang or tgt_lang:
        data = dataclasses.replace(
            data, src_lang=src_lang or data.src_lang, tgt_lang=tgt_lang or data.tgt_lang, corpora=[]
        )
        if data.src_lang == data.tgt_lang and (src_lang or not src_file):  # a --src file's language: unknown
            source = f"--src-lang {src_lang}" if src_lang else f"the checkpoint's data.src_lang {data.src_lang}"
            target = f"--tgt-lang {tgt_lang}" if tgt_lang else f"the checkpoint's data.tgt_lang {data.tgt_lang}"
            raise DataError(
                f"{source} into {target}: source and target are the same language; give another "
                + ("--tgt-lang" if src_lang else "--src-lang")
            )
    translator.tgt_lang = translator.target_language(
        tgt_lang or (None if src_file else data.tgt_lang), knob="--tgt-lang "
    )
    if pivot:
        _check_pivot(pivot, translator, data.src_lang, data.tgt_lang)
    if src_file or ref_file:
        if not (src_file and ref_file):
            raise DataError("give both --src and --ref")
        for flag, file in (("--src", src_file), ("--ref", ref_file)):
            _check_file(flag, file)
        sources, references = read_lines(Path(src_file)), read_lines(Path(ref_file))
        if len(sources) != len(references):
            raise DataError(f"line counts differ: {src_file} has {len(sources)}, {ref_file} has {len(references)}")
        name = Path(src_file).name
        if translator.config.data.target_languages():  # one file, several target languages: one result each
            name += f".to-{data.tgt_lang}"
    else:
        sources, references = load_split_text(data, split)
        name = f"{split}.{data.src_lang}-{data.tgt_lang}" if src_lang or tgt_lang else split
    if not sources:
        raise DataError(f"{src_file or f'the {split} split'}: no sentences to translate and score")
    if augment:  # the references too, where the variant changes the target side
        sources, references = augment_pairs(sources, references, augment, augment_seed)
    tokenized_references = None
    if tokenized_lc:
        _check_file("--tokenized-lc", tokenized_lc)
        tokenized_references = read_lines(Path(tokenized_lc))
        if len(tokenized_references) != len(sources):
            raise DataError(
                f"--tokenized-lc {tokenized_lc}: {len(tokenized_references)} lines for {len(sources)} "
                f"sources; give the tokenized references of the same {name} lines"
            )
        if not data.tgt_lang:
            raise DataError(
                "--tokenized-lc tokenizes for the target language, and the checkpoint's data.tgt_lang is not set"
            )
    beam = translator.config.decode.beam_size if request.beam_size is None else request.beam_size
    name += (
        (f".ensemble{len(checkpoints)}" if len(checkpoints) > 1 else "")
        + (f".{quantize}" if quantize else "")
        + (f".aug-{augment}" if augment else "")
        + (f".{label}" if label else "")
    )
    hyp_path, json_path = output_paths(checkpoint, name, beam)
    source = str(Path(src_file).resolve()) if src_file else None
    if _results_of_another_source(json_path, source):  # test.de of two directories, or a --src file named test
        name += "." + hashlib.sha256(str(source or split).encode()).hexdigest()[:6]
        hyp_path, json_path = output_paths(checkpoint, name, beam)
    inputs = {
        f"the --src file {src_file}": src_file,
        f"the --ref file {ref_file}": ref_file,
        **{f"the checkpoint {each}": each for each in checkpoints},
    }
    noised_paths = (hyp_path.with_suffix(".src"), hyp_path.with_suffix(".ref")) if augment else ()
    for path in (hyp_path, json_path, *noised_paths):
        overwritten = overwritten_input(path, inputs)
        if overwritten:
            raise DataError(
                f"{path}: is {overwritten}; evaluate writes its results there, which would destroy "
                "it; move or rename that file"
            )
        problem = write_problem(path)
        if problem:  # found now, not after translating everything
            raise DataError(
                f"{path}: cannot be written ({problem.lower()}); evaluate writes its results beside the "
                "checkpoint: copy or link it into a directory you can write to"
            )
    started = time.perf_counter()
    asked = dataclasses.replace(request, beam_size=beam, tgt_lang=None)  # the language: translator.tgt_lang
    hypotheses = translator.translate(sources, asked, progress=sys.stderr.isatty())
    seconds = time.perf_counter() - started
    result = {
        "checkpoint": str(checkpoint),
        "split": name,
        "src": source,
        "ref": str(Path(ref_file).resolve()) if ref_file else None,
        "src_lang": data.src_lang,
        "tgt_lang": data.tgt_lang,
        "sentences": len(sources),
        "beam_size": beam,
        **(
            {"alpha": translator.config.decode.alpha_for(translator.tgt_lang) if alpha is None else alpha}
            if beam > 1
            else {}
        ),
        **({"ensemble": [str(each) for each in checkpoints], "weights": weights} if len(checkpoints) > 1 else {}),
        **({"quantize": quantize} if quantize else {}),
        **(_augment_record(augment, augment_seed) if augment else {}),
        "seconds": round(seconds, 2),
        **score(hypotheses, references, data.tgt_lang),
    }
    if tokenized_references is not None:
        result.update(tokenized_lowercased_bleu(hypotheses, tokenized_references, data.tgt_lang))
    model_data = translator.config.data
    if model_data.target_languages():  # a multilingual model: how often it answers in another language
        result.update(off_target(hypotheses, data.tgt_lang, model_data.languages()) or {})
    if pivot:
        result["pivot"] = _through(translator, sources, references, asked, pivot, model_data.languages())
        pivot_path = output_paths(checkpoint, f"{name}.pivot-{pivot}", beam)[0]
        pivot_path.write_text("".join(h.replace("\n", " ") + "\n" for h in result["pivot"].pop("lines")))
        result["pivot"]["hypotheses_file"] = str(pivot_path)
    hyp_path.write_text("".join(h.replace("\n", " ") + "\n" for h in hypotheses), encoding="utf-8")
    for path, lines in zip(noised_paths, (sources, references)):  # what was translated and scored
        path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines), encoding="utf-8")
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    result["hypotheses_file"], result["scores_file"] = str(hyp_path), str(json_path)
    if augment:
        result["noised_src_file"], result["noised_ref_file"] = map(str, noised_paths)
    return result


def _check_pivot(pivot: str, translator, src_lang: str, tgt_lang: str) -> None:
    """--pivot LANG: a target language of a multilingual model, other than the direction's two."""
    if not translator.target_languages:
        raise DataError(f"--pivot {pivot}: a bilingual model translates into one language; leave --pivot out")
    if pivot not in translator.target_languages:
        raise DataError(
            f"--pivot {pivot}: not a language this model translates into ({', '.join(translator.target_languages)})"
        )
    if pivot in (src_lang, tgt_lang):
        raise DataError(f"--pivot {pivot}: it is an end of {src_lang} -> {tgt_lang}; give a third language")


def _through(translator, sources: list[str], references: list[str], asked, pivot: str, languages) -> dict:
    """The sources translated into `pivot`, then those translations into the evaluated target language, by the
    same model and request: the second step scored, the off-target rate of each step, the final lines."""
    from transformer.data.langid import off_target
    from transformer.inference.scoring import score

    target = translator.tgt_lang
    started = time.perf_counter()
    try:
        translator.tgt_lang = pivot
        middle = translator.translate(sources, asked, progress=sys.stderr.isatty())
        translator.tgt_lang = target
        final = translator.translate(middle, asked, progress=sys.stderr.isatty())
    finally:
        translator.tgt_lang = target
    scores = score(final, references, target)
    first_step = off_target(middle, pivot, languages) or {}
    return {
        "via": pivot,
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "seconds": round(time.perf_counter() - started, 2),
        **(off_target(final, target, languages) or {}),
        **({"off_target_into_pivot": first_step["off_target"]} if "off_target" in first_step else {}),
        "lines": final,
    }


def _augment_record(augment: str, seed: int) -> dict:
    """What the JSON records of a noised evaluation: the variant, its seed, the typo rate where it has typos."""
    return {
        "augment": augment,
        "augment_seed": seed,
        **({"typo_rate": EVALUATION_TYPO_RATE} if augment in ("typos", "mix") else {}),
    }


def _results_of_another_source(json_path: Path, source: str | None) -> bool:
    """Whether `json_path` holds the scores of another source file (`source`: this one's resolved path,
    None for a split), which writing these results would overwrite; results of releases that did not
    record the source are overwritten as before."""
    try:
        recorded = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and "src" in recorded and recorded["src"] != source


def _check_file(flag: str, file: str) -> None:
    """DataError naming the flag unless `file` is a file one can read lines from."""
    if Path(file).is_dir():
        raise DataError(f"{flag} {file}: is a directory; give a file of one sentence per line")
    if not Path(file).exists():
        raise DataError(f"{flag} {file}: no such file")


def output_paths(checkpoint: str | Path, name: str, beam: int) -> tuple[Path, Path]:
    """The hypotheses and the scores of an evaluation: beside the checkpoint file or model directory,
    or in the working directory for a HuggingFace Hub id (`owner/name` -> owner--name.NAME.beamN.hyp)."""
    stem = Path(checkpoint).with_suffix("") if Path(checkpoint).exists() else Path(str(checkpoint).replace("/", "--"))
    return Path(f"{stem}.{name}.beam{beam}.hyp"), Path(f"{stem}.{name}.beam{beam}.json")
