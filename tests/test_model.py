import pytest
import torch

from transformer.attention import padding_mask
from transformer.config import ModelConfig
from transformer.data.tokenizer import BOS_ID, PAD_ID
from transformer.model import build_model


def _model(pre_norm=True, shared=True, protected=4, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0, pre_norm=pre_norm, **kw
    )
    return build_model(cfg, 50, 50 if shared else 60, shared_vocab=shared, protected_ids=protected).eval()


@pytest.mark.parametrize("pre_norm", [True, False])
def test_incremental_decoding_matches_full_recomputation(pre_norm):
    model = _model(pre_norm)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[BOS_ID, 11, 12, 13, 14, 15], [BOS_ID, 16, 17, 18, 19, 20]])
    memory = model.encode(src)
    pad = padding_mask(src, PAD_ID)
    full = model.decode(tgt, memory, pad)  # (B, T, V)
    cache = model.new_cache(memory, pad)
    steps = [model.decode(tgt[:, t : t + 1], None, None, cache) for t in range(tgt.size(1))]
    incremental = torch.cat(steps, dim=1)
    assert (incremental - full).abs().max() < 1e-4


def test_future_target_tokens_do_not_change_earlier_logits():
    model = _model()
    src = torch.tensor([[5, 6, 7, 3]])
    a = torch.tensor([[BOS_ID, 11, 12, 13]])
    b = torch.tensor([[BOS_ID, 11, 40, 41]])
    la, lb = model(src, a), model(src, b)
    assert torch.allclose(la[:, :2], lb[:, :2], atol=1e-6)
    assert not torch.allclose(la[:, 2:], lb[:, 2:], atol=1e-3)


def test_source_padding_does_not_change_outputs():
    model = _model()
    src = torch.tensor([[5, 6, 7, 3]])
    src_padded = torch.tensor([[5, 6, 7, 3, 0, 0, 0]])
    tgt = torch.tensor([[BOS_ID, 11, 12]])
    assert torch.allclose(model(src, tgt), model(src_padded, tgt), atol=1e-5)


def test_tied_embeddings_and_shapes():
    model = _model()
    assert model.output.weight is model.tgt_embed.weight is model.src_embed.weight
    separate = _model(shared=False)
    assert separate.src_embed is not separate.tgt_embed
    assert separate.output.weight is separate.tgt_embed.weight
    logits = separate(torch.tensor([[5, 3]]), torch.tensor([[BOS_ID, 7, 8]]))
    assert logits.shape == (1, 3, 60)


def test_presets_have_the_papers_sizes():
    from tests.helpers import compose_config

    base = compose_config(["model=base"]).model
    big = compose_config(["model=big"]).model
    assert (base.d_model, base.d_ff, base.n_heads, base.encoder_layers, base.decoder_layers) == (512, 2048, 8, 6, 6)
    assert (big.d_model, big.d_ff, big.n_heads, big.encoder_layers, big.decoder_layers) == (1024, 4096, 16, 6, 6)
    model = build_model(base, 37000, 37000, shared_vocab=True)
    params = sum(p.numel() for p in model.parameters())
    assert 60e6 < params < 66e6  # the paper's base model: 65M parameters with a 37k vocabulary


def test_cpu_dropout_rate_scale_and_gradient():
    from transformer.model import Dropout

    torch.manual_seed(0)
    layer = Dropout(0.25).train()
    x = torch.ones(400, 500, requires_grad=True)
    out = layer(x)
    dropped = out == 0
    assert abs(dropped.float().mean().item() - 0.25) < 0.005
    # Each 64-bit draw serves four neighbouring elements: every one of the four must get its own
    # uniform 15 bits (random_() leaves the fourth lane's top bit 0 and gives the other three a sign bit:
    # unmasked, lanes 1-3 would drop 0.625 of their elements, lane 4 0.25).
    per_lane = dropped.view(-1, 4).float().mean(0)
    assert torch.allclose(per_lane, torch.full((4,), 0.25), atol=0.01), per_lane
    assert torch.allclose(out[~dropped], torch.tensor(1 / 0.75))
    out.sum().backward()
    assert torch.equal(x.grad == 0, dropped)  # gradient flows only where kept
    torch.manual_seed(0)
    assert torch.equal(layer(x), out)  # reproducible from the seed
    assert torch.equal(layer.eval()(x), x)
    half = torch.ones(300, 300, dtype=torch.bfloat16)
    out = layer.train()(half)
    assert out.dtype == torch.bfloat16
    assert set(out.unique().tolist()) == {0.0, float(torch.tensor(1 / 0.75, dtype=torch.bfloat16))}


@pytest.mark.parametrize("branch_dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_added_to_the_residual_equals_the_unfused_sum(branch_dtype):
    # Sublayer's residual + dropout(f) is one addcmul on the CPU; with the same seed it must give the
    # unfused residual + Dropout(f), its gradients, and keep the branch's dtype for f's gradient
    # (an fp32 residual stream next to a bf16 branch under autocast).
    from transformer.model import Dropout

    layer = Dropout(0.3).train()
    residual = torch.randn(6, 9, 40, requires_grad=True)
    branch = torch.randn(6, 9, 40, dtype=branch_dtype, requires_grad=True)
    upstream = torch.randn(6, 9, 40)
    torch.manual_seed(3)
    fused = layer.add_to(residual, branch)
    assert type(fused.grad_fn).__name__ == "_CpuDropoutBackward"  # the fused path ran
    (fused * upstream).sum().backward()
    grads = residual.grad.clone(), branch.grad.clone()
    residual.grad = branch.grad = None
    torch.manual_seed(3)
    unfused = residual + layer(branch)
    (unfused * upstream).sum().backward()
    assert fused.dtype == unfused.dtype == torch.float32
    tolerance = 1e-6 if branch_dtype == torch.float32 else 2e-2  # unfused rounds the dropped branch to bf16
    assert torch.allclose(fused, unfused, rtol=tolerance, atol=tolerance)
    assert 0.25 < (fused == residual).float().mean().item() < 0.35  # dropped: the residual alone
    assert torch.equal(grads[0], residual.grad)  # the residual's gradient passes
    assert grads[1].dtype == branch_dtype
    assert torch.allclose(grads[1].float(), branch.grad.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(layer.eval().add_to(residual, branch), residual + branch)


def test_dropout_that_drops_nothing_runs_no_operator():
    # In eval mode (every decoding step) and at p=0, Dropout hands back its input itself: no aten::dropout
    # per call. The profiler counts the operators that ran.
    from transformer.model import Dropout

    x = torch.randn(4, 3, 8)
    for layer in (Dropout(0.3).eval(), Dropout(0.0).train()):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = layer(x)
            summed = layer.add_to(x, x)
        assert out is x
        assert torch.equal(summed, 2 * x)
        ran = {event.key for event in profile.key_averages()}
        assert "aten::dropout" not in ran and "aten::add" in ran


def test_feed_forward_relu_after_dropout_matches_the_textbook_order():
    # FeedForward applies the ReLU in place after dropout; with the same mask that must equal
    # down(dropout(relu(up(x)))) exactly, gradients included.
    from transformer.model import FeedForward

    ff = FeedForward(16, 64, dropout=0.3).train()
    x = torch.randn(5, 7, 16, requires_grad=True)
    torch.manual_seed(11)
    out = ff(x)
    out.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in ff.parameters()]
    x.grad = None
    ff.zero_grad()
    torch.manual_seed(11)
    reference = ff.down(ff.dropout(torch.relu(ff.up(x))))
    reference.square().sum().backward()
    assert torch.equal(out, reference)
    for got, want in zip(grads, [x.grad] + [p.grad for p in ff.parameters()]):
        assert torch.allclose(got, want, atol=1e-6)


def _embedded(model, ids, p):
    """The encoder's embedding of `ids` with source word dropout `p` (embedding dropout off)."""
    return model._embed(model.src_embed, ids, word_dropout=p)


def test_word_dropout_zeroes_whole_tokens_at_its_rate_scales_the_rest_and_keeps_the_protected_ids():
    model = _model(protected=6).train()  # ids 0-5 protected: specials and two "language tags"
    torch.manual_seed(1)
    ids = torch.randint(1, 50, (64, 40))  # (B, S); no padding, whose embedding is zero anyway
    plain = model._embed(model.src_embed, ids)  # the reference: no word dropout (dropout=0)
    positions = model.positions(ids.size(1))
    torch.manual_seed(2)
    dropped = _embedded(model, ids, 0.25)
    token_part, plain_part = dropped - positions, plain - positions  # (B, S, D) embeddings
    zeroed = token_part.abs().sum(-1) == 0  # (B, S)
    droppable = ids >= 6
    assert not zeroed[~droppable].any()  # specials and tags never dropped
    torch.testing.assert_close(token_part[~droppable], plain_part[~droppable])  # nor scaled
    share = zeroed[droppable].float().mean().item()
    assert abs(share - 0.25) < 0.02  # 2,400 droppable tokens: sd 0.009
    kept = droppable & ~zeroed
    torch.testing.assert_close(token_part[kept], plain_part[kept] / 0.75)  # inverted: 1 / (1 - p)
    torch.manual_seed(2)
    torch.testing.assert_close(_embedded(model, ids, 0.25), dropped)  # the seed decides


def test_word_dropout_is_off_in_eval_mode_and_changes_training_outputs():
    src, tgt = torch.tensor([[7, 8, 9, 10, 3]]), torch.tensor([[2, 11, 12, 13]])
    model = _model(src_word_dropout=0.5, tgt_word_dropout=0.5)
    reference = _model()  # the same weights (seed 0), no word dropout
    torch.testing.assert_close(model(src, tgt), reference(src, tgt))  # eval: identity
    model.train(), reference.train()
    outputs = {tuple(model(src, tgt).flatten().tolist()) for _ in range(8)}
    assert len(outputs) > 1  # dropout 0 otherwise: only word dropout varies
    assert torch.allclose(reference(src, tgt), reference(src, tgt))


@pytest.mark.parametrize("key", ["model.src_word_dropout", "model.tgt_word_dropout"])
def test_word_dropout_outside_zero_to_one_is_refused(key):
    from transformer.config import ConfigError

    cfg = ModelConfig(**{key.split(".")[1]: 1.0})
    with pytest.raises(ConfigError, match=rf"^{key}=1.0 must be in \[0, 1\)$"):
        cfg.validate()


def _encode_by_hand(model, src, residual_free_layer):
    """The encoder written out: each layer x + attn(norm(x)) then x + ff(norm(x)) (dropout 0, pre-norm),
    the residual of layer `residual_free_layer`'s self-attention (1-based) left out."""
    allowed = (src != PAD_ID)[:, None, None, :]  # (B, 1, 1, S)
    x = model.src_embed(src) * model.cfg.d_model**0.5 + model.positions(src.size(1))  # (B, S, D)
    for number, layer in enumerate(model.encoder_layers, start=1):
        attended = layer.self_attn(layer.sub_attn.norm(x), key_allowed=allowed)
        x = attended if number == residual_free_layer else x + attended
        x = x + layer.feed_forward(layer.sub_ff.norm(x))
    return model.encoder_norm(x)


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_a_residual_free_encoder_layer_drops_that_layers_attention_residual_and_nothing_else(layer):
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_heads=4, d_ff=64, encoder_layers=3, decoder_layers=2, dropout=0.0)
    usual = build_model(ModelConfig(**cfg), 50, 50, shared_vocab=True).eval()
    free = build_model(ModelConfig(**cfg, residual_free_layer=layer), 50, 50, shared_vocab=True).eval()
    assert free.state_dict().keys() == usual.state_dict().keys()  # the same weights: no parameter added
    free.load_state_dict(usual.state_dict())
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    with torch.no_grad():
        assert torch.allclose(usual.encode(src), _encode_by_hand(usual, src, 0), atol=1e-5)
        assert torch.allclose(free.encode(src), _encode_by_hand(usual, src, layer), atol=1e-5)
        assert (free.encode(src) - usual.encode(src)).abs().max() > 1e-2
    assert [sub.sub_attn.residual for sub in free.encoder_layers] == [n != layer for n in (1, 2, 3)]
    assert all(sub.sub_ff.residual for sub in free.encoder_layers)


def test_a_residual_free_layer_trains_and_keeps_padding_out():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, encoder_layers=3, decoder_layers=2, residual_free_layer=2)
    model = build_model(cfg, 50, 50, shared_vocab=True).eval()
    src, padded = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[5, 6, 7, 3, 0, 0]])
    tgt = torch.tensor([[BOS_ID, 11, 12]])
    assert torch.allclose(model(src, tgt), model(padded, tgt), atol=1e-5)
    model.train()
    model(src, tgt).logsumexp(-1).mean().backward()
    first_weight = next(model.encoder_layers[0].self_attn.parameters())
    assert first_weight.grad is not None and first_weight.grad.abs().sum() > 0  # the gradient still reaches layer 1


@pytest.mark.parametrize("value", [-1, 4])
def test_a_residual_free_layer_outside_the_encoder_is_refused_with_the_range(value):
    from transformer.config import ConfigError

    expected = rf"model.residual_free_layer={value} .* give 1 to 3 \(a middle one, e.g. 2\)"
    with pytest.raises(ConfigError, match=expected):
        ModelConfig(encoder_layers=3, residual_free_layer=value).validate()
