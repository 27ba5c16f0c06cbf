"""The model card (README.md) of the safetensors directory: HuggingFace Hub metadata, the languages, the
training data, the shape, the validation scores and how to load it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from transformer.config import Config
from transformer.data.tokenizer import Tokenizer
from transformer.inference.model_directory import CONFIG_FILE, FORMAT_NAME, WEIGHTS_FILE

if TYPE_CHECKING:
    from transformer.model import Transformer


def model_card(
    model: Transformer,
    tokenizer: Tokenizer,
    config: Config,
    name: str,
    trained: dict,
    export_format: str = "safetensors",
) -> str:
    """README.md of the exported directory `name` (`export_format`: safetensors or transformers):
    HuggingFace Hub metadata (YAML front matter), then the languages, the training data, the model's
    shape, the checkpoint's validation scores and how to load it. `trained`: the checkpoint's `step`
    and `metrics` (either may be missing)."""
    data, shape = config.data, config.model
    src, tgt = data.src_lang, data.tgt_lang
    directions, targets = data.directions(), tokenizer.target_languages
    languages = data.languages() if targets or data.corpora else [src, tgt]
    # library_name: one the Hub knows and users can install; our own package is not on PyPI, so the
    # safetensors directory names none.
    front = [
        "---",
        *(["library_name: transformers"] if export_format == "transformers" else []),
        "language:",
        *(f"- {json.dumps(x)}" for x in languages),
        "tags:",
        "- translation",
        "pipeline_tag: translation",
        "license: other",
    ]
    title = (
        f"multilingual translation ({', '.join(f'{a} → {b}' for a, b in directions)})"
        if targets
        else f"{src} → {tgt} translation"
    )
    said = (
        (
            f"Directions trained: {', '.join(f'`{a}` → `{b}`' for a, b in directions)}. Choose the target "
            f"language ({', '.join(f'`{x}`' for x in targets)}) with `tgt_lang=` or `--tgt-lang`: its tag "
            f"(`<2{targets[0]}>`, ...) starts every source sentence."
        )
        if targets
        else f"Source `{src}`, target `{tgt}`."
    )
    if data.hub_id:
        front += ["datasets:", f"- {json.dumps(data.hub_id)}"]
    front += _model_index(name, config, trained)
    parameters = sum(p.numel() for p in model.parameters())  # a tied matrix counts once
    vocabulary = (
        f"one joint SentencePiece {data.tokenizer_type} vocabulary of {tokenizer.src_vocab_size} pieces"
        if tokenizer.joint
        else f"SentencePiece {data.tokenizer_type} vocabularies of "
        f"{tokenizer.src_vocab_size} ({src}) and {tokenizer.tgt_vocab_size} ({tgt}) pieces"
    )
    lines = [
        *front,
        "---",
        "",
        f"# {name}: {title}",
        "",
        f"A Transformer encoder-decoder (Vaswani et al., 2017) trained with `{FORMAT_NAME}` (the Python "
        + (
            "package `transformer`), exported as a HuggingFace `transformers` model."
            if export_format == "transformers"
            else "package `transformer`). This directory is that package's safetensors format: weights "
            f"(`{WEIGHTS_FILE}`), training config (`{CONFIG_FILE}`) and SentencePiece model(s)."
        ),
        "",
        "## Languages",
        "",
        said,
        "",
        "## Training data",
        "",
        _training_data(data),
        "",
        "## Model",
        "",
        f"- {parameters:,} parameters{' (embeddings tied)' if shape.tie_embeddings else ''}",
        f"- {shape.encoder_layers} encoder and {shape.decoder_layers} decoder layers, d_model {shape.d_model}, "
        f"{shape.n_heads} attention heads, feed-forward {shape.d_ff}, "
        f"{'pre' if shape.pre_norm else 'post'}-norm, at most {shape.max_positions} positions",
        f"- {vocabulary}",
        "",
        "## Evaluation",
        "",
        "\n\n".join(_evaluation(config, trained)),
        "",
        "## How to load it",
        "",
        *(
            _load_transformers(name, config, targets)
            if export_format == "transformers"
            else _load_ours(name, config, targets)
        ),
        "## License",
        "",
        "The terms of the training data apply to the model; set `license` above before publishing it.",
        "",
    ]
    return "\n".join(lines)


def _load_ours(name: str, config: Config, targets: list[str]) -> list[str]:
    """How to load the safetensors directory: with this package only."""
    src, tgt = config.data.src_lang, config.data.tgt_lang
    choose = f', tgt_lang="{tgt}"' if targets else ""
    return [
        "```python",
        "from transformer import Translator",
        "",
        f'translator = Translator.from_pretrained("{name}")    # this directory, or its Hub id owner/name',
        f'print(translator.translate(["..."]{choose}))',
        "```",
        "",
        "From the command line, one translation per input line:",
        "",
        "```sh",
        f"transformer-translate {name}{' --tgt-lang ' + tgt if targets else ''} < input.{src} > output.{tgt}",
        "```",
        "",
        "HuggingFace `transformers` cannot load this directory: the architecture is not a `transformers` "
        f"model class; load it with the `{FORMAT_NAME}` package as above, or export the checkpoint with "
        "`transformer-export CKPT --format transformers OUT`, which `transformers` loads.",
        "",
    ]


def _load_transformers(name: str, config: Config, targets: list[str]) -> list[str]:
    """How to load the transformers export: with `transformers` alone (no remote code)."""
    architecture = "PegasusForConditionalGeneration" if config.model.pre_norm else "MarianMTModel"
    tag = f">>{config.data.tgt_lang}<< " if targets else ""
    lines = [
        f"A native `transformers` model (`{architecture}`, `MarianTokenizer`): no `trust_remote_code`, and "
        f"this package is not needed.",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")    # this directory, or its Hub id owner/name',
        f'model = AutoModelForSeq2SeqLM.from_pretrained("{name}")',
        f'batch = tokenizer(["{tag}..."], return_tensors="pt", padding=True)',
        "output = model.generate(**batch, num_beams=5)",
        "print(tokenizer.batch_decode(output, skip_special_tokens=True))",
        "```",
        "",
    ]
    lines += [
        f"With the `{FORMAT_NAME}` package (`Translator`, `transformer-translate`), load the `.pt` checkpoint "
        "this was exported from, or its `transformer-export --format safetensors` directory.",
        "",
    ]
    if targets:
        lines += [
            f"The target language is chosen by its tag at the start of the source text, as for Marian's "
            f"multilingual models: {', '.join(f'`>>{x}<<`' for x in targets)}.",
            "",
        ]
    return lines


def _model_index(name: str, config: Config, trained: dict) -> list[str]:
    """The Hub's `model-index` results (YAML front matter): the test scores of these weights when the run
    recorded them (test_results.json), else the last validation's; nothing when there are none."""
    data = config.data
    test = trained.get("test")
    metrics = trained.get("metrics") if isinstance(trained.get("metrics"), dict) else {}
    history = [v for v in metrics.get("val_history") or [] if isinstance(v, dict) and "bleu" in v]
    if test:
        split, bleu, chrf, signature = test.get("split"), test["bleu"], test.get("chrf"), test.get("bleu_signature")
    elif history:
        split, bleu, chrf = data.split_name(data.valid_split), history[-1]["bleu"], history[-1].get("chrf")
        signature = metrics.get("bleu_signature")
    else:
        return []
    dataset = data.hub_id or data.name
    metric_lines = [
        "    - type: bleu",
        f"      value: {round(float(bleu), 2)}",
        f"      name: {json.dumps('BLEU (sacreBLEU, ' + str(split) + ')')}",
    ]
    if signature:
        metric_lines.append(f"      args: {json.dumps(signature)}")
    if isinstance(chrf, (int, float)):
        metric_lines += [
            "    - type: chrf",
            f"      value: {round(float(chrf), 2)}",
            f"      name: {json.dumps('chrF (sacreBLEU, ' + str(split) + ')')}",
        ]
    task = f"Translation {data.src_lang}-{data.tgt_lang}" if not data.corpora else "Translation"
    return [
        "model-index:",
        f"- name: {json.dumps(name)}",
        "  results:",
        "  - task:",
        "      type: translation",
        f"      name: {json.dumps(task)}",
        "    dataset:",
        f"      name: {json.dumps(dataset)}",
        f"      type: {json.dumps(dataset)}",
        f"      split: {json.dumps(str(split))}",
        "    metrics:",
        *metric_lines,
    ]


def _training_data(data) -> str:
    """The card's training data: the corpus and its splits, or the corpora of a mixture."""
    if not data.corpora:
        return (
            f"{_data_source(data)} (data preset `{data.name}`); splits: train `{data.split_name(data.train_split)}`, "
            f"validation `{data.split_name(data.valid_split)}`, test `{data.split_name(data.test_split)}`. "
            f"Training pairs longer than {data.max_len} tokens on either side were left out."
        )
    corpora = "; ".join(
        f"`{corpus.label(data)}`: {'`' + corpus.path + '`' if corpus.path else 'hub `' + str(corpus.hub_id) + '`'}, "
        f"{corpus.src_lang or data.src_lang} → {corpus.tgt_lang or data.tgt_lang}, weight {corpus.weight:g}"
        for corpus in data.corpora
    )
    source = _data_source(data)
    return (
        f"{len(data.corpora)} corpora mixed in each epoch by (weight × pairs)^(1/{data.temperature:g}) (data "
        f"preset `{data.name}`): {corpora}. Validation and test: {source[0].lower()}{source[1:]}. Training "
        f"pairs longer than {data.max_len} tokens on either side were left out."
    )


def _data_source(data) -> str:
    if data.path:
        return f"Local files in `{data.path}`"
    if data.hub_id:
        which = f", configuration `{data.hub_config}`" if data.hub_config else ""
        return f"The HuggingFace Hub dataset [`{data.hub_id}`](https://huggingface.co/datasets/{data.hub_id}){which}"
    return f"The generated toy corpus of `transformer/data/toy.py`, {data.embedded_pairs:,} training pairs"


def _evaluation(config: Config, trained: dict) -> list[str]:
    """The card's scores: those the checkpoint records, said for what they are."""
    metrics = trained.get("metrics") if isinstance(trained.get("metrics"), dict) else {}
    history = [v for v in metrics.get("val_history") or [] if isinstance(v, dict) and "bleu" in v]
    step = trained.get("step")
    lines = []
    if history:
        last = history[-1]
        tc = config.trainer
        sample = f"its first {tc.val_max_sentences} sentences" if tc.val_max_sentences else "all of it"
        lines.append(
            f"On the validation split (`{config.data.split_name(config.data.valid_split)}`, {sample}, "
            f"beam {tc.val_beam_size}), at step {last.get('step')}: BLEU {last['bleu']:.2f}, "
            f"chrF {last.get('chrf', float('nan')):.2f} (sacreBLEU, hypotheses and references in NFC)."
        )
        if step is not None and step != last.get("step"):
            lines.append(f"The exported weights are those of step {step}.")
    for key, label in (("bleu_signature", "BLEU signature"), ("chrf_signature", "chrF signature")):
        if metrics.get(key):
            lines.append(f"{label}: `{metrics[key]}`")
    test = trained.get("test")
    if test:
        lines.append(
            f"On the test split (`{test.get('split')}`, {test.get('sentences')} sentences, beam {test.get('beam')}), "
            f"at the end of training, of these weights (step {test.get('step')}): BLEU {test['bleu']:.2f}, "
            f"chrF {test.get('chrf', float('nan')):.2f}."
        )
        for key, label in (("bleu_signature", "Test BLEU signature"), ("chrf_signature", "Test chrF signature")):
            if test.get(key):
                lines.append(f"{label}: `{test[key]}`")
    elif "test_bleu" in metrics:
        lines.append(f"Test split: BLEU {metrics['test_bleu']:.2f}, chrF {metrics.get('test_chrf', float('nan')):.2f}.")
    if "averaged_from" in metrics:
        lines.append(
            f"The weights are the average of {len(metrics['averaged_from'])} checkpoints; the scores "
            "above are those the last of them recorded."
        )
    return lines or ["The checkpoint records no validation scores (`transformer-evaluate` scores a checkpoint)."]
