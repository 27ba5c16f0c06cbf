"""`Translator`: the Python API (`from transformer import Translator`) and the one text-to-text path
behind the command line, validation, the test at the end of training, evaluate and the bench. Its decoding
options (beam_size, alpha, ...) are defined and checked once, with the config's: `config.DECODE_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.config import QUANTIZATIONS, check_decode_options, check_weights
from transformer.console import bars_disabled
from transformer.data.batching import batches_in_order, pad_sequences
from transformer.inference.decoders import Hypothesis
from transformer.inference.request import DecodeRequest
from transformer.inference.search import Search, translate_ids
from transformer.kernels import is_int8, quantize_linear_layers
from transformer.model import eval_mode
from transformer.runtime import DTYPES, Runtime, autocast_factory
from transformer.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# Target tokens per batch when scoring references (`Translator.score`).
SCORE_BATCH_TOKENS = 2048


class Translator:
    """Text in, text out: the one path from raw sentences to translations, for the command line, the
    Python API, validation and the test at the end of training, `evaluate` and the bench.

    >>> Translator.from_checkpoint("best.pt").translate(["Ein Hund rennt."], beam_size=5)
    ['A dog is running.']

    Constructed around a model in use (training's), it leaves the model where it is and in the mode it
    was in; `from_checkpoint` / `from_pretrained` move theirs to `device` in eval mode.
    `from_checkpoints` makes an ensemble: several models over one vocabulary, decoding together.
    """

    def __init__(
        self,
        model,
        tokenizer,
        config,
        device: torch.device,
        precision: str = "fp32",
        autocast=None,
        tgt_lang: str | None = None,
    ):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.tgt_lang = tgt_lang  # a multilingual model's default target language
        self.models, self.weights = [model], None  # an ensemble: `from_checkpoints`
        self.max_length = model.cfg.max_positions - 1  # tokens of a sentence, EOS or BOS aside
        self.device = torch.device(device)
        if precision not in DTYPES:
            raise ValueError(f"precision={precision!r} must be one of {', '.join(DTYPES)}")
        self.autocast = autocast or autocast_factory(self.device, DTYPES[precision])

    @property
    def quantized(self) -> bool:
        """Whether the model's linear layers are int8 (`quantize="int8"`)."""
        return is_int8(self.model)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, device: str = "auto", precision: str = "auto", quantize: str | None = None
    ) -> Translator:
        """A `.pt` checkpoint written by training. `quantize="int8"`: the linear layers' weights in int8
        (CPU only; the rest in float32): `inference_model`."""
        runtime = inference_runtime(device, precision, quantize)
        model, tokenizer, config = model_from_checkpoint(load_checkpoint(path, mmap=True), path)
        return cls(inference_model(model, runtime, quantize), tokenizer, config, runtime.device, runtime.precision)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "auto", precision: str = "auto", quantize: str | None = None
    ) -> Translator:
        """A directory written by `transformer-export --format safetensors`, or a HuggingFace Hub id holding one
        (`owner/name`, downloaded and cached by huggingface_hub)."""
        from transformer.inference.pretrained import load_pretrained

        runtime = inference_runtime(device, precision, quantize)
        model, tokenizer, config = load_pretrained(path)
        return cls(inference_model(model, runtime, quantize), tokenizer, config, runtime.device, runtime.precision)

    @classmethod
    def load(
        cls, path: str | Path, device: str = "auto", precision: str = "auto", quantize: str | None = None
    ) -> Translator:
        """A checkpoint file, an exported directory, or a hub id (`owner/name`, nothing of that name on
        disk): what the command lines accept."""
        from transformer.inference.pretrained import looks_like_hub_id

        if Path(path).is_dir() or looks_like_hub_id(path):
            return cls.from_pretrained(path, device, precision, quantize)
        return cls.from_checkpoint(path, device, precision, quantize)

    @classmethod
    def from_checkpoints(
        cls,
        paths: list[str | Path],
        weights: list[float] | None = None,
        device: str = "auto",
        precision: str = "auto",
        quantize: str | None = None,
    ) -> Translator:
        """An ensemble of checkpoints (or exported directories, as `load` takes them) trained with the same
        SentencePiece model(s): at every step the weighted mean of their log-probabilities (equal
        weights by default). The first one's decode settings are the defaults. CheckpointError names a
        model whose vocabulary differs from the first's; ValueError for weights that do not fit."""
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)  # one path: an ensemble of one
        if not paths:
            raise ValueError("from_checkpoints needs at least one checkpoint")
        if weights is not None:
            weights = check_weights(weights, len(paths))
        members = [cls.load(path, device, precision, quantize) for path in paths]
        first = members[0]
        wanted = first.translates()
        for path, member in zip(paths[1:], members[1:]):
            if member.tokenizer.fingerprint() != first.tokenizer.fingerprint():
                raise CheckpointError(
                    f"{path}: its SentencePiece vocabulary differs from that of {paths[0]}; an "
                    "ensemble needs models trained with the same SentencePiece model(s)"
                )
            if (translated := member.translates()) != wanted:
                raise CheckpointError(
                    f"{path} translates {translated} but {paths[0]} translates {wanted}: "
                    "the models of an ensemble must translate the same languages into the same ones"
                )
            if (side := member.language_tag) != first.language_tag:
                raise CheckpointError(
                    f"{path} reads its language tag with data.language_tag={side}, {paths[0]} with "
                    f"{first.language_tag}: the models of an ensemble must read the tag alike"
                )
        first.models, first.weights = [member.model for member in members], weights
        first.max_length = min(member.max_length for member in members)
        return first

    def translates(self) -> str:
        """What the model translates, as an ensemble must agree on it: `de -> en`, `de, fr -> en` (one
        target language) or `into en, fr` (a multilingual model: its target set, whatever the sources)."""
        if self.target_languages:
            return f"into {', '.join(self.target_languages)}"
        directions = self.config.data.directions()
        sources = ", ".join(sorted({str(src) for src, _ in directions}))
        return f"{sources} -> {', '.join(sorted({str(tgt) for _, tgt in directions}))}"

    @property
    def language_tag(self) -> str:
        """Where a multilingual model reads its target-language tag (data.language_tag; older
        checkpoints: the source)."""
        return getattr(self.config.data, "language_tag", "source") if self.target_languages else "source"

    @property
    def target_languages(self) -> list[str]:
        """What a multilingual model translates into (`tgt_lang=`); [] for a bilingual one."""
        return self.tokenizer.target_languages

    def target_language(self, tgt_lang: str | None, knob: str = "tgt_lang=") -> str | None:
        """The target language whose tag starts each source: `tgt_lang` or the default, checked; None for
        a bilingual model, which takes no tag (its own target language is accepted). ValueError in one
        line naming the languages there are, and `knob` as the way to give one."""
        languages = self.target_languages
        data = self.config.data
        language = tgt_lang or self.tgt_lang
        if not languages:
            if language not in (None, data.tgt_lang):
                named = knob if tgt_lang else "Translator.tgt_lang="
                raise ValueError(
                    f"{named}{language}: this model translates {data.src_lang} -> {data.tgt_lang} only; "
                    "leave the target language out"
                )
            return None
        if language is None:
            raise ValueError(
                f"this model translates into several languages ({', '.join(languages)}): choose one with {knob}LANG"
            )
        if language not in languages:
            raise ValueError(
                f"{knob}{language}: not a target language of this model; it translates into {', '.join(languages)}"
            )
        return language

    def encode_sources(
        self, sentences: list[str], tgt_lang: str | None = None, tag_empty: bool | list[bool] = False
    ) -> list[list[int]]:
        """Source token ids, each cut to the model's positions (with one warning for all that were; a
        lower-case source keeps its sentence's marker at the end); a multilingual model's start with the tag
        of `tgt_lang` (`target_language`). An empty one stays empty (it is not translated) unless `tag_empty`
        (all, or one flag per sentence): forced decoding, or a prefix to continue, where the tag alone says
        the target language."""
        limit = self.max_length
        language = self.target_language(tgt_lang)
        sources = self.tokenizer.encode_src([s.strip() for s in sentences])
        if language is not None and self.language_tag != "decoder":
            tag = self.tokenizer.tag_id(language)
            tagged = tag_empty if isinstance(tag_empty, list) else [tag_empty] * len(sources)
            sources = [[tag, *ids] if ids or wanted else [] for ids, wanted in zip(sources, tagged)]
        truncated = sum(len(s) > limit for s in sources)
        if truncated:
            warnings.warn(
                f"{truncated} source sentence(s) longer than {limit} tokens were truncated "
                "to the model's maximum length",
                stacklevel=3,
            )
        marked = self.tokenizer.sentence_marker_ids  # a lower-case source's last piece: kept when it is cut
        return [s[: limit - 1] + s[-1:] if len(s) > limit and s[-1] in marked else s[:limit] for s in sources]

    def translate_hypotheses(
        self, sentences: list[str], request: DecodeRequest | None = None, **options
    ) -> list[list[tuple[str, float]]]:
        """n-best (text, score) lists, best first; the arguments of `hypotheses`."""
        return [[(h.text, h.score) for h in hyps] for hyps in self.hypotheses(sentences, request, **options)]

    def hypotheses(
        self,
        sentences: list[str],
        request: DecodeRequest | None = None,
        *,
        progress: bool | None = False,
        desc: str = "translate",
        stop=None,
        **options,
    ) -> list[list[Hypothesis]]:
        """n-best `Hypothesis` lists (text, score, tokens, ...), best first, for what `request` asks
        (`DecodeRequest`; or its fields as keywords, `options`: beam_size=5, tgt_lang="fr", ...). Options
        left out come from the config's decode section (`DecodeConfig.for_translation`), and a bad one is
        a ValueError naming it. Empty sentences translate to ''. `progress`: a tqdm bar (None: when stderr
        is a terminal); `stop()`, asked between batches, may raise `errors.Interrupted`."""
        if request is not None and options:
            raise TypeError(f"give a DecodeRequest or its options as keywords, not both ({', '.join(options)})")
        if request is not None and not isinstance(request, DecodeRequest):
            raise TypeError(f"request={request!r}: give a DecodeRequest, or the options as keywords (beam_size=5)")
        request = request or DecodeRequest(**options)
        sentences = list_of_str(sentences, "sentences", "translate([text])")
        language = self.target_language(request.tgt_lang)  # refused before anything else is done
        if stop is not None and not callable(stop):
            raise TypeError(f"stop={stop!r}: must be a function asked between batches (True stops the decoding)")
        search = self.search(request, language, len(sentences))
        prefix_ids = search.prefixes
        sources = self.encode_sources(
            sentences, request.tgt_lang, tag_empty=[bool(ids) for ids in prefix_ids] if prefix_ids else False
        )
        # An empty sentence translates to '' unless it has a prefix, which its translation starts with.
        wanted = [i for i, s in enumerate(sources) if s or (prefix_ids is not None and prefix_ids[i])]
        if prefix_ids is not None:
            search = dataclasses.replace(search, prefixes=[prefix_ids[i] for i in wanted])
        results: list[list[Hypothesis]] = [[] for _ in sources]
        with tqdm(
            total=len(wanted), desc=desc, unit="sent", leave=False, disable=bars_disabled(progress is not False)
        ) as bar:
            decoded = translate_ids(
                self.models,
                [sources[i] for i in wanted],
                search,
                device=self.device,
                weights=self.weights,
                autocast=self.autocast,
                progress=bar,
                stop=stop,
            )
        for index, hyps in zip(wanted, decoded):
            results[index] = hyps
        flat = [h for hyps in results for h in hyps]
        for hyp, text in zip(flat, self.tokenizer.decode_tgt([h.tokens for h in flat])):
            hyp.text = text
        return [
            hyps or [Hypothesis(tokens=[], score=0.0, logprob=0.0) for _ in range(search.nbest)] for hyps in results
        ]

    def search(self, request: DecodeRequest, language: str | None, count: int) -> Search:
        """`request` resolved against this model's decode section, checked (a ValueError names the
        option), its prefixes encoded (`count` sentences)."""
        if request.workers is not None and (type(request.workers) is not int or request.workers < 1):
            raise ValueError(f"workers={request.workers!r}: must be a whole number >= 1 (None: one per core)")
        sampling, given = request.sampling, request.search_options()
        if sampling is not None:
            searched = [f"{name}={given[name]}" for name in ("beam_size", "nbest") if given[name] not in (None, 1)]
            if searched:
                raise ValueError(f"sampling draws one translation per sentence: leave out {' and '.join(searched)}")
        prefix_ids = self.encode_prefixes(request.prefixes, count)
        alpha = given["alpha"]
        decode = self.config.decode.for_translation(
            **{**given, "alpha": self.config.decode.alpha_for(language) if alpha is None else alpha}
        )
        if alpha is not None and (sampling is not None or decode.beam_size == 1):
            warnings.warn(
                f"alpha={alpha} is ignored by greedy search and sampling (the length penalty ranks the "
                "hypotheses of a beam of 2 or more)",
                stacklevel=4,
            )
        if too_wide := self.beam_error(decode.beam_size, "beam_size="):
            raise ValueError(too_wide)
        batch_tokens = decode.batch_tokens
        if self.quantized and given["batch_tokens"] is None:  # int8 runs fastest on batches of a few thousand
            rows = 1 if sampling is not None or decode.beam_size == 1 else decode.beam_size
            batch_tokens = min(batch_tokens, INT8_SOURCE_TOKENS * rows)
        return Search(
            beam_size=decode.beam_size,
            alpha=decode.alpha,
            nbest=decode.nbest,
            max_len_a=decode.max_len_a,
            max_len_b=decode.max_len_b,
            batch_tokens=batch_tokens,
            sampling=sampling,
            prefixes=prefix_ids,
            workers=cpu_workers(self.device) if request.workers is None else request.workers,
            use_cache=request.use_cache,
            doubled_by=self.tokenizer.sentence_marker_ids,
            **self.tag_in_decoder(language),
        )

    def tag_in_decoder(self, language: str | None) -> dict:
        """`Search.start` and `never` for a model that reads its target-language tag in the decoder: the tag
        in place of BOS, and no tag ever generated; {} otherwise."""
        if language is None or self.language_tag == "source":
            return {}
        return {"start": self.tokenizer.tag_id(language), "never": self.tokenizer.tag_ids}

    def beam_error(self, beam_size: int, knob: str) -> str | None:
        """A beam wider than the target vocabulary: more hypotheses than pieces to extend them with, time
        and memory for nothing (a beam of 10**9 ran for good). None for a beam that fits."""
        vocabulary = self.tokenizer.tgt_vocab_size
        if beam_size <= vocabulary:
            return None
        return (
            f"{knob}{beam_size}: the model's target vocabulary has {vocabulary} pieces; give at most that (5 is usual)"
        )

    def encode_prefixes(self, prefixes, count: int) -> list[list[int]] | None:
        """Target token ids of each prefix, cut to leave room for EOS; None when no sentence has one."""
        if prefixes is None:
            return None
        prefixes = list_of_str(prefixes, "prefixes", "translate([text], prefixes=[prefix])")
        if len(prefixes) != count:
            raise ValueError(
                f"{len(prefixes)} prefixes for {count} sentences: give one prefix per sentence ('' for none)"
            )
        if not any(p.strip() for p in prefixes):
            return None
        encoded = self.tokenizer.encode_tgt([p.strip() for p in prefixes])
        unknown = self.unknown_prefix_characters(prefixes, encoded)
        if unknown:
            index, characters = unknown
            raise ValueError(f"prefixes[{index}]={prefixes[index]!r}: {characters}")
        limit = self.max_length - 1  # room for EOS
        cut = sum(len(ids) > limit for ids in encoded)
        if cut:
            warnings.warn(
                f"{cut} prefix(es) longer than {limit} tokens were cut to the model's maximum length", stacklevel=3
            )
        return [ids[:limit] for ids in encoded]

    def unknown_prefix_characters(self, prefixes: list[str], encoded: list[list[int]] | None = None):
        """The first prefix with characters the target vocabulary cannot spell, as (index, what to say of
        them); None when every prefix can be spelt. Such a character would become the unknown piece, which
        comes out as ' ⁇ ', and the translation would no longer start with the prefix given."""
        encoded = encoded or self.tokenizer.encode_tgt([p.strip() for p in prefixes])
        for index, (prefix, ids) in enumerate(zip(prefixes, encoded)):
            if UNK_ID not in ids:
                continue
            characters = [
                c for c in dict.fromkeys(prefix) if not c.isspace() and UNK_ID in self.tokenizer.encode_tgt([c])[0]
            ]
            spelled = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in characters) or "some characters"
            return index, (
                f"{spelled} not in the model's target vocabulary: the translation could not start with this "
                "prefix (they would come out as ⁇); write the prefix without them"
            )
        return None

    @torch.inference_mode()
    def score(
        self, sentences: list[str], references: list[str], batch_tokens: int | None = None, tgt_lang: str | None = None
    ) -> list[float]:
        """Log-probability of each reference translation given its source under the model (forced
        decoding): the sum over its tokens and the final EOS, as sentence scores for filtering corpora.
        An ensemble's is the weighted mean of its models' (as its search scores each token). Sources and
        references longer than the model's positions are truncated. `tgt_lang`: as for `hypotheses`."""
        sentences = list_of_str(sentences, "sentences", "score([source], [reference])")
        references = list_of_str(references, "references", "score([source], [reference])")
        if len(sentences) != len(references):
            raise ValueError(
                f"{len(sentences)} sources but {len(references)} references: give one reference per source"
            )
        if batch_tokens is not None:
            check_decode_options({"batch_tokens": batch_tokens}, "api")
        sources = self.encode_sources(sentences, tgt_lang, tag_empty=True)
        targets = self.tokenizer.encode_tgt([r.strip() for r in references])
        cut = sum(len(ids) > self.max_length for ids in targets)
        if cut:
            warnings.warn(
                f"{cut} reference(s) longer than {self.max_length} tokens were cut to the model's maximum "
                "length: their scores cover only their beginning",
                stacklevel=2,
            )
        targets = [ids[: self.max_length] for ids in targets]
        widths = [max(len(a), len(b)) for a, b in zip(sources, targets)]
        scores = [0.0] * len(sources)
        weights = self.weights or [1.0] * len(self.models)
        shares = [w / sum(weights) for w in weights]
        # The (B, T, V) float32 log-probabilities bound the batch: 2048 tokens x 32k pieces = 256 MB.
        start = self.tag_in_decoder(self.target_language(tgt_lang)).get("start", BOS_ID)  # what the decoder reads first
        for indices in batches_in_order(widths, batch_tokens or SCORE_BATCH_TOKENS):
            src = pad_sequences([sources[i] for i in indices], suffix=[EOS_ID]).to(self.device)  # (B, S)
            tgt = [targets[i] for i in indices]
            tgt_in = pad_sequences(tgt, prefix=[BOS_ID])  # (B, T)
            tgt_in[:, 0] = start
            tgt_in = tgt_in.to(self.device)
            tgt_out = pad_sequences(tgt, suffix=[EOS_ID]).to(self.device)  # (B, T)
            sums = 0.0
            for model, share in zip(self.models, shares):
                with self.autocast(), eval_mode(model):
                    logits = model(src, tgt_in)  # (B, T, V)
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, tgt_out[:, :, None]).squeeze(2)
                sums = sums + share * logprobs.masked_fill(tgt_out == PAD_ID, 0.0).sum(dim=1)  # (B,)
            for index, value in zip(indices, sums.tolist()):
                scores[index] = value
        return scores

    def translate(self, sentences: list[str], request: DecodeRequest | None = None, **options) -> list[str]:
        """One translation per sentence (the best hypothesis): `translate(["Ein Hund."], beam_size=5)`, or
        with a `DecodeRequest`; the arguments of `hypotheses`."""
        return [hyps[0][0] for hyps in self.translate_hypotheses(sentences, request, **options)]


# Source tokens per batch (times the beam) of an int8 model when batch_tokens is not given: its dynamic
# int8 layers run faster on batches of this size than on the float default's (10,000 Multi30k sentences,
# greedy, two workers: 7.6 s against 8.5 s, whole processes).
INT8_SOURCE_TOKENS = 4096


def cpu_workers(device: torch.device) -> int:
    """How many batches to decode at a time by default: on the CPU one per thread PyTorch would use (the
    cores, or OMP_NUM_THREADS), each on one core, which beats every core on each small batch (measured
    in docs/benchmarks.md); elsewhere 1."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def inference_runtime(device: str, precision: str, quantize: str | None) -> Runtime:
    """`Runtime.for_inference`, with the precision an int8 model computes in (float32 around its int8
    matrix products; on the CPU only). ValueError naming the setting that does not fit."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize={quantize!r}: must be {' or '.join(QUANTIZATIONS)} (or left out)")
    if quantize and precision not in ("auto", "fp32"):
        raise ValueError(f"quantize={quantize} runs float32 around its int8 layers: leave precision={precision} out")
    runtime = Runtime.for_inference(device, "fp32" if quantize else precision)
    if quantize and runtime.device.type != "cpu":
        raise ValueError(
            f"quantize={quantize} is for the CPU (PyTorch's dynamic int8 linear layers); on "
            f"{runtime.device} leave it out"
        )
    return runtime


def inference_model(model: torch.nn.Module, runtime: Runtime, quantize: str | None = None) -> torch.nn.Module:
    """The model on the runtime's device in eval mode; with `quantize="int8"`, its linear layers replaced
    by `Int8Linear` ones (weights int8 per output row, activations quantized on the fly per token)."""
    model = model.to(runtime.device).eval()
    return quantize_linear_layers(model) if quantize == "int8" else model


def list_of_str(sentences, name: str, example: str) -> list[str]:
    """`sentences` (a list or any iterable of str, consumed once) as a list; a TypeError naming the
    argument otherwise (a str alone would be taken as one sentence per character)."""
    items = None
    if not isinstance(sentences, (str, bytes)):
        try:
            items = list(sentences)
        except TypeError:  # not iterable
            pass
    kind = (
        type(sentences).__name__
        if items is None
        else next((type(s).__name__ for s in items if not isinstance(s, str)), None)
    )
    if kind is not None:
        raise TypeError(f"{name} must be a list of str (got {kind}); for one sentence write {example}")
    return items
