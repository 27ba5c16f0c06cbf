"""What a run writes to TensorBoard (transformer/training/monitor.py)."""

import numpy as np
import pytest

from tests.helpers import FAST, compose_config
from transformer.training.monitor import attention_figure, figure_pixels


def test_the_attention_heatmap_labels_both_axes_with_the_sentence_tokens_on_a_0_to_1_scale():
    source = ["▁Ein", "▁Hund", "▁läuft", "</s>"]
    predicted = ["▁A", "▁dog", "▁runs", "</s>"]
    weights = np.full((4, 4), 0.05)
    np.fill_diagonal(weights, 0.85)
    figure = attention_figure(weights, source, predicted, title="step 10")
    heatmap = figure.axes[0]
    assert [t.get_text() for t in heatmap.get_xticklabels()] == source
    assert [t.get_text() for t in heatmap.get_yticklabels()] == predicted
    assert "predicts" in heatmap.get_ylabel() and "source" in heatmap.get_xlabel()
    image = heatmap.get_images()[0]
    assert image.get_clim() == (0.0, 1.0)  # not normalised by its own maximum
    assert image.colorbar is not None and len(figure.axes) == 2  # the heatmap and its colour bar
    pixels = figure_pixels(figure)
    assert pixels.dtype == np.uint8 and pixels.shape[2] == 3 and min(pixels.shape[:2]) >= 250


def test_the_figure_grows_with_the_target_tokens_up_to_a_cap():
    def size(n):
        return attention_figure(
            np.zeros((n, n)), [f"s{i}" for i in range(n)], [f"t{i}" for i in range(n)]
        ).get_size_inches()

    assert size(20)[1] > size(5)[1]
    assert (size(500) <= np.array([6.4, 9.6])).all()


@pytest.mark.parametrize("tokens", [12, 20])
def test_a_heatmap_is_one_sentence_whose_labels_are_legible_in_tensorboards_default_card(tokens):
    """TensorBoard fits an image to its card, 335 px wide at the least: a tick label is 8 px or more
    there, and the image is not so tall that the card shrinks it by its height."""
    source, predicted = [f"▁s{i}" for i in range(tokens)], [f"▁t{i}" for i in range(tokens)]
    figure = attention_figure(np.full((tokens, tokens), 0.1), source, predicted, title="sentence 1")
    height, width = figure_pixels(figure).shape[:2]
    scale = 335 / width
    assert len(figure.axes) == 2 and height <= 1.6 * width  # one heatmap and its colour bar
    for label in figure.axes[0].get_xticklabels() + figure.axes[0].get_yticklabels():
        assert label.get_fontsize() * figure.dpi / 72 * scale >= 8.0, label.get_text()


def test_per_head_and_per_layer_panels_are_the_weights_the_mean_picture_averages(untrained_checkpoint):
    """trainer.attention_heatmaps=heads: each head of the last layer (their mean is the default picture);
    =layers: each layer's mean over heads (the last one is the default picture); labelled panels."""
    from transformer.checkpoint import load_checkpoint, model_from_checkpoint
    from transformer.training.validate import cross_attention, cross_attention_panels

    model, _, config = model_from_checkpoint(load_checkpoint(untrained_checkpoint))
    source, hypothesis = [5, 9, 14, 20], [7, 8, 11]
    mean = cross_attention(model, source, hypothesis, "cpu")  # (T, S) = (4, 5)
    heads = cross_attention_panels(model, source, hypothesis, "cpu", "heads")
    layers = cross_attention_panels(model, source, hypothesis, "cpu", "layers")
    assert [label for label, _ in heads] == [f"last layer, head {h + 1}" for h in range(config.model.n_heads)]
    assert len(layers) == config.model.decoder_layers and mean.shape == (4, 5)
    assert np.allclose(np.mean([w for _, w in heads], axis=0), mean, atol=1e-6)
    assert np.allclose(layers[-1][1], mean, atol=1e-6)
    assert not np.allclose(heads[0][1], heads[1][1])  # heads really differ
    assert all(np.allclose(w.sum(axis=1), 1.0, atol=1e-5) for _, w in heads + layers)  # rows are distributions
    label, weights = heads[0]
    figure = attention_figure(weights, list("abcde"), list("wxyz"), label, scale_label="w")
    assert figure.axes[0].get_title() == "last layer, head 1"


@pytest.mark.slow
def test_a_run_writes_test_scores_config_hparams_one_loss_chart_and_the_attention_image(tmp_path, data_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from transformer.training.trainer import train

    cfg = compose_config(
        FAST
        + [
            "trainer.attention_heatmaps=heads",
            "data.embedded_pairs=600",
            "trainer.max_steps=6",
            "trainer.validate_every=6",
            "trainer.log_every=3",
            "trainer.test_at_end=true",
            "trainer.ema_decay=0.9",
            "trainer.val_max_sentences=8",
            "decode.beam_size=1",
        ],
        cache_dir=data_cache,
    )
    metrics = train(cfg, tmp_path)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    scalars = set(tags["scalars"])
    assert {
        "test/bleu",
        "test/chrf",
        "loss/train",
        "loss/valid",
        "loss/valid_ema",
        "accuracy/valid",
        "accuracy/train",
        "val/accuracy",
        "train/epoch",
        "train/lr",
        "val/best_bleu",
    } <= scalars, scalars
    assert any(tag.startswith("memory/") for tag in scalars)
    assert events.Scalars("test/bleu")[-1].value == pytest.approx(metrics["test_bleu"])
    config = events.Tensors("config/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert config.startswith("```yaml") and "d_model: 64" in config and "max_steps: 6" in config
    assert set(events.PluginTagToContent("hparams")) == {  # in the run's own file, not a subdirectory
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    }
    assert "custom_scalars__config__" in tags["tensors"]
    images = set(tags["images"])
    assert {"val/cross_attention_1", "val_ema/cross_attention_1", "val/cross_attention_heads_1"} <= images
    assert "val_ema/samples/text_summary" in tags["tensors"]
    picture = events.Images("val/cross_attention_1")[-1]
    assert picture.width >= 250 and picture.height >= 250


def test_sweep_jobs_are_named_by_their_number_and_swept_values(monkeypatch):
    import transformer.training.sweep as sweep

    monkeypatch.setattr(
        sweep,
        "_swept_keys",
        sweep.swept_keys(
            ["trainer.lr=1e-3,5e-4", "model=tiny,small", "trainer.max_steps=5", "data.cache_dir=/tmp/data"]
        ),
    )
    assert sweep._swept_keys == {"trainer.lr", "model"}
    overrides = ["trainer.lr=0.001", "model=small", "trainer.max_steps=5", "data.cache_dir=/tmp/data"]
    assert sweep.job_name(3, overrides) == "3_trainer.lr=0.001,model=small"
    monkeypatch.setattr(sweep, "_swept_keys", None)  # unknown (another launcher): every override
    name = sweep.job_name(3, overrides)
    assert name.startswith("3_trainer.lr=0.001,model=small,trainer.max_steps=5") and "/" not in name
    assert len(sweep.job_name(0, [f"data.path=/{'x' * 300}"])) <= sweep.MAX_JOB_NAME
