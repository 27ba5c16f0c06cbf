"""`--format ctranslate2`: a CTranslate2 model directory (through `ctranslate2.specs`) with the
SentencePiece model(s) beside it. CTranslate2 (the `export` extra) is imported only
here. CTranslate2 takes SentencePiece pieces as input: the exported model adds the source EOS itself, as
our encoder expects."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.data.tokenizer import Tokenizer
from transformer.errors import (
    CheckpointError,
)
from transformer.inference.model_directory import write_model_directory
from transformer.inference.pretrained import refuse_non_finite
from transformer.install import install_hint

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformer.model import Transformer


CT2_QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def ctranslate2_spec(model: Transformer, tokenizer: Tokenizer):
    """Our architecture as a `ctranslate2.specs.TransformerSpec`, weights set (float32, on the CPU)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.n_heads,
        pre_norm=cfg.pre_norm,
        activation=common_spec.Activation.RELU,
    )
    spec.config.layer_norm_epsilon = model.encoder_layers[0].sub_attn.norm.eps
    spec.config.add_source_eos = True  # our encoder reads "pieces </s>"
    weight = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}

    def linear(target, name):
        target.weight = weight[f"{name}.weight"]
        if f"{name}.bias" in weight:
            target.bias = weight[f"{name}.bias"]

    def norm(target, name):
        target.gamma, target.beta = weight[f"{name}.weight"], weight[f"{name}.bias"]

    table = model.positions.table.float().cpu()  # (max_positions, D)
    for side in (spec.encoder, spec.decoder):
        side.scale_embeddings = True  # x * sqrt(D) + PE
        side.position_encodings.encodings = table
    spec.encoder.embeddings[0].weight = weight["src_embed.weight"]
    spec.decoder.embeddings.weight = weight["tgt_embed.weight"]
    linear(spec.decoder.projection, "output")
    if cfg.pre_norm:
        norm(spec.encoder.layer_norm, "encoder_norm")
        norm(spec.decoder.layer_norm, "decoder_norm")
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{scope}.self_attn.qkv_proj")  # (3D, D): Q, K, V rows
        linear(layer.self_attention.linear[1], f"{scope}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{scope}.sub_attn.norm")
        linear(layer.ffn.linear_0, f"{scope}.feed_forward.up")
        linear(layer.ffn.linear_1, f"{scope}.feed_forward.down")
        norm(layer.ffn.layer_norm, f"{scope}.sub_ff.norm")
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder_layers.{i}"
        linear(layer.self_attention.linear[0], f"{scope}.self_attn.qkv_proj")
        linear(layer.self_attention.linear[1], f"{scope}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{scope}.sub_self.norm")
        linear(layer.attention.linear[0], f"{scope}.cross_attn.q_proj")
        linear(layer.attention.linear[1], f"{scope}.cross_attn.kv_proj")  # (2D, D): K, V rows
        linear(layer.attention.linear[2], f"{scope}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{scope}.sub_cross.norm")
        linear(layer.ffn.linear_0, f"{scope}.feed_forward.up")
        linear(layer.ffn.linear_1, f"{scope}.feed_forward.down")
        norm(layer.ffn.layer_norm, f"{scope}.sub_ff.norm")
    pieces = [tokenizer.src.id_to_piece(i) for i in range(tokenizer.src_vocab_size)]
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary([tokenizer.tgt.id_to_piece(i) for i in range(tokenizer.tgt_vocab_size)])
    return spec


def casing_instructions(tokenizer: Tokenizer) -> str | None:
    """What CTranslate2's users must do to a source and an output that SentencePiece alone does not (the
    model's inline casing), or None."""
    if not tokenizer.inline_case:
        return None
    titles = ", with the words of the exported titles.txt as `titles` (data.usual_case)" if tokenizer.titles else ""
    source = (
        "encode_source(text) (data.lowercase_source=true)" if tokenizer.lowercase_source else f"encode(text){titles}"
    )
    return (
        "the model has inline casing (data.inline_case=true): CTranslate2's users must write each source as "
        f"transformer.data.casing.{source} before SentencePiece and read each output through casing.decode{titles} "
        "(transformer-translate does both)"
    )


def export_ctranslate2(
    model: Transformer,
    tokenizer: Tokenizer,
    out: str | Path,
    quantization: str | None = None,
    overwrite: bool = False,
    language_tag: str = "source",
) -> Path:
    if model.cfg.residual_free_layer:
        raise ValueError(
            f"model.residual_free_layer={model.cfg.residual_free_layer}: that encoder layer's self-attention adds "
            "no residual, which CTranslate2's Transformer cannot express; export --format safetensors instead"
        )
    try:
        from ctranslate2.converters.converter import Converter
    except ImportError:
        raise CheckpointError(f"--format ctranslate2 needs CTranslate2: {install_hint('export')}") from None
    if quantization is not None and quantization not in CT2_QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: one of {', '.join(CT2_QUANTIZATIONS)}")
    refuse_non_finite(model, "the model")
    instructions = casing_instructions(tokenizer)
    if instructions:
        log.warning("%s", instructions)
    if tokenizer.target_languages and language_tag != "source":
        raise ValueError(
            "the model reads its target-language tag in the decoder (data.language_tag): CTranslate2 would need "
            "it as a target prefix, which this export does not write yet; export --format safetensors instead"
        )

    class _Ours(Converter):  # CTranslate2's own validate / optimize (quantize) / save
        def _load(self):
            return ctranslate2_spec(model, tokenizer)

    def build(directory: Path) -> None:
        _Ours().convert(str(directory), quantization=quantization)

    return write_model_directory(out, overwrite, tokenizer, build, "ctranslate2")
