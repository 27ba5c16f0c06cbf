"""trainer.compile: each layer compiled in place (`model.compile_layers`), on the CPU with the real compiler.

What broke on an H100 (first GPU run): the whole-model graph took over a minute per compilation (the
layers are compiled one by one now, and the fused loss is never traced). On the CPU the fast dropout
mask broke the graph at every layer. Each is pinned here."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from transformer.config import ModelConfig
from transformer.inference.search import Search, translate_ids
from transformer.loss import output_cross_entropy
from transformer.model import build_model, compile_layers

SHAPES = [(6, 9, 7), (5, 11, 13), (7, 4, 6), (6, 16, 9), (6, 9, 7)]  # (sentences, source, target)


def batches(vocab: int = 60):
    gen = torch.Generator().manual_seed(0)
    for b, s, t in SHAPES:
        yield torch.randint(4, vocab, (b, s), generator=gen), torch.randint(4, vocab, (b, t), generator=gen)


def tiny(dropout: float):
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=dropout, attention_dropout=dropout
    )
    return build_model(cfg, 60, 60, True)


def losses_and_grads(model):
    out = []
    for src, tgt in batches():
        hidden = model(src, tgt, return_hidden=True).flatten(0, 1)
        loss, _, _ = output_cross_entropy(hidden, model.output.weight, tgt.flatten(), 0.1)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return out


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow  # compiles with inductor: ~15 s each
def test_compiled_layers_train_like_eager_and_compile_once_per_mode(fresh_dynamo):
    eager, compiled = tiny(0.0), tiny(0.0)
    compile_layers(compiled)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints stay loadable
    for (loss_e, grads_e), (loss_c, grads_c) in zip(losses_and_grads(eager), losses_and_grads(compiled)):
        assert torch.allclose(loss_c, loss_e, rtol=1e-5)
        assert all(torch.allclose(c, e, atol=1e-5) for c, e in zip(grads_c, grads_e))
    # five batch shapes, one graph per layer class (not per layer, not per shape); the loss not traced
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.slow  # compiles with inductor: ~15 s each
def test_the_cpu_dropout_mask_does_not_break_the_compiled_graph(fresh_dynamo):
    model = tiny(0.1).train()
    compile_layers(model)
    for src, tgt in batches():
        model(src, tgt, return_hidden=True).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2 and not counters["graph_break"]


@pytest.mark.slow  # compiles with inductor: ~15 s each
def test_cached_decoding_stays_eager_and_unchanged(fresh_dynamo):
    eager, compiled = tiny(0.0).eval(), tiny(0.0).eval()
    compile_layers(compiled)
    sources = [src[0].tolist() for src, _ in batches()]
    for beam in (1, 3):
        expected = translate_ids(eager, sources, Search(beam_size=beam, max_len_b=6))
        got = translate_ids(compiled, sources, Search(beam_size=beam, max_len_b=6))
        assert [h[0].tokens for h in got] == [h[0].tokens for h in expected]
    assert counters["stats"].get("unique_graphs", 0) <= 1  # the encoder's eval graph, nothing per step


def test_the_inference_side_does_not_load_the_compiler():
    """torch._dynamo costs a second of start-up: the translation CLI and the loss must not import it
    (a `torch.compiler.disable` decorator on the fused loss once did)."""
    import subprocess
    import sys

    code = "import sys, transformer.cli.translate, transformer.loss; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
