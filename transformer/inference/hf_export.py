"""`transformer-export CKPT --format transformers OUT`: a checkpoint as a native HuggingFace `transformers`
model, which `AutoModelForSeq2SeqLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load
offline without `trust_remote_code`.

Which architecture, and why. Our model is the paper's encoder-decoder: sinusoidal positions from 0,
embeddings scaled by sqrt(D), ReLU feed-forward, biases on every projection and none on the output layer,
LayerNorms of eps 1e-5, post-norm or (model.pre_norm=true) pre-norm with a final LayerNorm closing each
stack. Two `transformers` classes compute exactly that:

- post-norm -> `MarianMTModel`: post-norm, sinusoidal positions from 0 (no padding offset, unlike
  M2M-100's and FSMT's, which also use another frequency formula), `scale_embedding`, biases on q/k/v/o
  and the FFN, a zero `final_logits_bias`. It also covers separate source and target vocabularies
  (`share_encoder_decoder_embeddings=False`) and untied output layers (`tie_word_embeddings=False`).
- pre-norm -> `PegasusForConditionalGeneration`: the same layers in pre-norm order, with the final
  `layer_norm` of each stack, the same positions. Its encoder and decoder share one embedding matrix,
  so a pre-norm model with separate vocabularies or untied embeddings has no native class: it is
  refused (one line naming the key), not exported to something that translates differently.

Both write the sinusoid with the sines in the first half of the vector and the cosines in the second,
where ours interleaves them (sin at 2i, cos at 2i+1). Every LayerNorm, residual addition and embedding
acts on the model dimension element-wise or symmetrically, so the export permutes that dimension once
throughout (`RESIDUAL_ORDER`: the even columns, then the odd ones) and the computation is ours, reordered;
heads are untouched (only the inputs of q/k/v and the FFN, and the outputs of o and the FFN, are in the
permuted dimension).

The tokenizer is `MarianTokenizer` (SentencePiece, `sentencepiece` is one of our dependencies) with a
vocab.json that maps every piece to its SentencePiece id, so the ids are ours: the source, then EOS; the
decoder starts from BOS (`decoder_start_token_id`). A multilingual model's target-language tag `<2fr>` is
written `>>fr<<` in vocab.json, Marian's own convention: transformers users write `>>fr<< Ein Hund.` (the
tag first, then the text), as for the multilingual OPUS models, and get our tag id followed by the ids of
the sentence. generation_config.json holds our decoding defaults where transformers has them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.config import Config
from transformer.data.tokenizer import LANGUAGE_TAG, Tokenizer
from transformer.inference.model_directory import write_model_directory
from transformer.special import BOS_ID, EOS_ID, PAD_ID, UNK_ID

if TYPE_CHECKING:
    import torch

    from transformer.model import Transformer


def refusal(config: Config, tokenizer: Tokenizer) -> str | None:
    """Why this model has no exact native transformers class (the key to change), or None."""
    shape = config.model
    if tokenizer.inline_case:
        return (
            "the model was trained with data.inline_case=true, which transformers' MarianTokenizer does not write "
            "(lower-cased words with case markers); export --format safetensors or ctranslate2 instead"
        )
    if tokenizer.target_languages and getattr(config.data, "language_tag", "source") != "source":
        return (
            f"data.language_tag={config.data.language_tag}: the decoder starts from the target-language tag, "
            "where transformers' models start from one fixed token; export --format safetensors instead"
        )
    if shape.residual_free_layer:
        return (
            f"model.residual_free_layer={shape.residual_free_layer}: that encoder layer's self-attention adds no "
            "residual, which transformers' Marian and Pegasus layers cannot express; export --format safetensors"
        )
    if shape.d_model % 2:
        return f"model.d_model={shape.d_model} is odd; transformers' sinusoidal positions need an even width"
    if shape.pre_norm and not tokenizer.joint:
        return (
            "model.pre_norm=true with separate source and target vocabularies: the pre-norm architecture of "
            "transformers (Pegasus) shares one vocabulary; export --format safetensors or ctranslate2 instead"
        )
    if shape.pre_norm and not shape.tie_embeddings:
        return (
            "model.pre_norm=true with model.tie_embeddings=false: the pre-norm architecture of transformers "
            "(Pegasus) shares the source and target embeddings; export --format safetensors or ctranslate2 instead"
        )
    return None


def residual_order(d_model: int) -> torch.Tensor:
    """RESIDUAL_ORDER: new column j of the model dimension is our column order[j] (evens, then odds)."""
    import torch

    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def hf_config(model: Transformer, tokenizer: Tokenizer, config: Config):
    """The transformers config (MarianConfig or PegasusConfig) of `model`."""
    from transformers import MarianConfig, PegasusConfig

    shape = config.model
    common = dict(
        d_model=shape.d_model,
        encoder_layers=shape.encoder_layers,
        decoder_layers=shape.decoder_layers,
        encoder_attention_heads=shape.n_heads,
        decoder_attention_heads=shape.n_heads,
        encoder_ffn_dim=shape.d_ff,
        decoder_ffn_dim=shape.d_ff,
        activation_function="relu",
        dropout=shape.dropout,
        attention_dropout=shape.attention_dropout,
        activation_dropout=shape.dropout,  # ours drops the FFN's inner activations at model.dropout
        max_position_embeddings=shape.max_positions,
        scale_embedding=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,
        tie_word_embeddings=shape.tie_embeddings,
        is_encoder_decoder=True,
    )
    if shape.pre_norm:
        return PegasusConfig(vocab_size=tokenizer.src_vocab_size, **common)
    return MarianConfig(
        vocab_size=tokenizer.src_vocab_size,
        decoder_vocab_size=tokenizer.tgt_vocab_size,
        share_encoder_decoder_embeddings=tokenizer.joint and shape.tie_embeddings,
        **common,
    )


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names, the model dimension permuted (module docstring)."""
    order = residual_order(model.cfg.d_model)
    state: dict[str, torch.Tensor] = {}

    def reads(weight):  # a linear layer reading the residual stream: its input columns
        return weight[:, order]

    def writes(linear, prefix):  # a linear layer writing to it: its output rows
        state[f"{prefix}.weight"] = linear.weight[order]
        state[f"{prefix}.bias"] = linear.bias[order]

    def norm(layer_norm, prefix):
        state[f"{prefix}.weight"] = layer_norm.weight[order]
        state[f"{prefix}.bias"] = layer_norm.bias[order]

    def projections(linear, names, prefix):  # a fused (parts * D, D) projection split into its parts
        weights, biases = linear.weight.chunk(len(names)), linear.bias.chunk(len(names))
        for name, weight, bias in zip(names, weights, biases):
            state[f"{prefix}.{name}.weight"] = reads(weight)
            state[f"{prefix}.{name}.bias"] = bias

    def feed_forward(block, prefix):
        state[f"{prefix}.fc1.weight"] = reads(block.up.weight)
        state[f"{prefix}.fc1.bias"] = block.up.bias
        writes(block.down, f"{prefix}.fc2")

    for i, layer in enumerate(model.encoder_layers):
        prefix = f"model.encoder.layers.{i}"
        projections(layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), f"{prefix}.self_attn")
        writes(layer.self_attn.out_proj, f"{prefix}.self_attn.out_proj")
        norm(layer.sub_attn.norm, f"{prefix}.self_attn_layer_norm")
        feed_forward(layer.feed_forward, prefix)
        norm(layer.sub_ff.norm, f"{prefix}.final_layer_norm")
    for i, layer in enumerate(model.decoder_layers):
        prefix = f"model.decoder.layers.{i}"
        projections(layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), f"{prefix}.self_attn")
        writes(layer.self_attn.out_proj, f"{prefix}.self_attn.out_proj")
        norm(layer.sub_self.norm, f"{prefix}.self_attn_layer_norm")
        projections(layer.cross_attn.q_proj, ("q_proj",), f"{prefix}.encoder_attn")
        projections(layer.cross_attn.kv_proj, ("k_proj", "v_proj"), f"{prefix}.encoder_attn")
        writes(layer.cross_attn.out_proj, f"{prefix}.encoder_attn.out_proj")
        norm(layer.sub_cross.norm, f"{prefix}.encoder_attn_layer_norm")
        feed_forward(layer.feed_forward, prefix)
        norm(layer.sub_ff.norm, f"{prefix}.final_layer_norm")
    if model.cfg.pre_norm:
        norm(model.encoder_norm, "model.encoder.layer_norm")
        norm(model.decoder_norm, "model.decoder.layer_norm")
    tgt_embed = reads(model.tgt_embed.weight)
    if model.src_embed is model.tgt_embed:
        state["model.shared.weight"] = tgt_embed
        state["model.encoder.embed_tokens.weight"] = state["model.decoder.embed_tokens.weight"] = tgt_embed
    else:
        state["model.encoder.embed_tokens.weight"] = reads(model.src_embed.weight)
        state["model.decoder.embed_tokens.weight"] = tgt_embed
    state["lm_head.weight"] = reads(model.output.weight)
    table = reads(model.positions.table)  # our positions, in transformers' halves layout
    state["model.encoder.embed_positions.weight"] = state["model.decoder.embed_positions.weight"] = table
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def hf_model(model: Transformer, tokenizer: Tokenizer, config: Config):
    """The transformers model computing what `model` computes (eval mode)."""
    import torch
    from transformers import MarianMTModel, PegasusForConditionalGeneration

    reason = refusal(config, tokenizer)
    if reason:
        raise ValueError(f"cannot export to transformers: {reason}")
    hf_cfg = hf_config(model, tokenizer, config)
    architecture = PegasusForConditionalGeneration if config.model.pre_norm else MarianMTModel
    exported = architecture(hf_cfg)
    state = hf_state_dict(model)
    if "model.shared.weight" in state and not hasattr(exported.model, "shared"):
        state.pop("model.shared.weight")
    # Tied matrices are one parameter there: each of their names is copied into it, the same values.
    missing, unexpected = exported.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"final_logits_bias"}:
        raise RuntimeError(f"transformers model mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        exported.final_logits_bias.zero_()  # ours has no output bias
    return exported.eval()


def generation_config(config: Config):
    """generate()'s defaults: our beam, length limit and never-generated tokens. transformers divides a
    beam's log-probability by length ** length_penalty, not by GNMT's ((5 + length) / 6) ** alpha: with
    decode.alpha=0 both rank by the raw log-probability and the beams are ours; otherwise the nearest
    setting, length_penalty=alpha, is written (said in docs/translating.md)."""
    from transformers import GenerationConfig

    decode = config.decode
    return GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=EOS_ID,  # ours ends a hypothesis at its length limit with EOS too
        suppress_tokens=[PAD_ID, BOS_ID],  # tokens our search never generates
        num_beams=decode.beam_size,
        length_penalty=float(decode.alpha),
        early_stopping=True,  # a sentence is done when num_beams hypotheses have ended, as in ours
        max_length=config.model.max_positions,  # BOS + at most max_positions - 1 tokens, as ours
    )


def vocabulary(sp, tags: bool) -> dict[str, int]:
    """Piece -> SentencePiece id, every id; a language tag `<2xx>` as Marian's `>>xx<<` when `tags`."""
    pieces = {}
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if tags and piece.startswith("<2") and piece.endswith(">") and i > EOS_ID:
            language = piece[2:-1]
            if LANGUAGE_TAG.format(language) == piece:
                piece = f">>{language}<<"
        pieces[piece] = i
    return pieces


def write_tokenizer(tokenizer: Tokenizer, config: Config, directory: Path) -> None:
    """MarianTokenizer's files (source.spm, target.spm, vocab.json, target_vocab.json for separate
    vocabularies, tokenizer_config.json), written by MarianTokenizer itself."""
    from transformers import MarianTokenizer

    scratch = directory / "scratch-tokenizer"
    scratch.mkdir()
    (scratch / "source.spm").write_bytes(tokenizer.src_model_bytes)
    (scratch / "target.spm").write_bytes(tokenizer.tgt_model_bytes)
    multilingual = bool(tokenizer.target_languages)
    (scratch / "vocab.json").write_text(json.dumps(vocabulary(tokenizer.src, multilingual)), encoding="utf-8")
    separate = {}
    if not tokenizer.joint:
        (scratch / "target_vocab.json").write_text(json.dumps(vocabulary(tokenizer.tgt, False)), encoding="utf-8")
        separate = {"separate_vocabs": True, "target_vocab_file": str(scratch / "target_vocab.json")}
    pieces = [tokenizer.src.id_to_piece(i) for i in (PAD_ID, UNK_ID, EOS_ID)]
    hf_tokenizer = MarianTokenizer(
        source_spm=str(scratch / "source.spm"),
        target_spm=str(scratch / "target.spm"),
        vocab=str(scratch / "vocab.json"),
        source_lang=None if multilingual else config.data.src_lang,
        target_lang=None if multilingual else config.data.tgt_lang,
        pad_token=pieces[0],
        unk_token=pieces[1],
        eos_token=pieces[2],
        model_max_length=config.model.max_positions,
        **separate,
    )
    hf_tokenizer.save_pretrained(str(directory))
    shutil.rmtree(scratch)


def export_transformers(
    model: Transformer,
    tokenizer: Tokenizer,
    config: Config,
    out: str | Path,
    overwrite: bool = False,
    trained: dict | None = None,
) -> Path:
    """OUT for `AutoModelForSeq2SeqLM` / `AutoTokenizer`: config.json, generation_config.json,
    model.safetensors, the tokenizer's files, README.md (the model card) and the export's manifest.
    ValueError (one line, naming the key) for a model no native class computes exactly."""
    reason = refusal(config, tokenizer)
    if reason:
        raise ValueError(f"cannot export to transformers: {reason}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        from transformer.install import install_hint

        raise ValueError(f"--format transformers needs the transformers package: {install_hint('hf')}") from None
    from transformer.inference.model_card import model_card
    from transformer.inference.model_directory import output_directory
    from transformer.inference.pretrained import refuse_non_finite, without_local_paths

    refuse_non_finite(model, "the model")
    config = without_local_paths(config)
    exported = hf_model(model, tokenizer, config)
    exported.generation_config = generation_config(config)
    card = model_card(model, tokenizer, config, output_directory(out).name, trained or {}, "transformers")

    def build(directory: Path) -> None:
        exported.save_pretrained(str(directory))
        write_tokenizer(tokenizer, config, directory)
        (directory / "README.md").write_text(card, encoding="utf-8")

    return write_model_directory(out, overwrite, tokenizer, build, "transformers", sentencepiece=False)
