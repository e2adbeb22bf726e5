"""The SUPERB downstream on per-utterance frame means equals the frame-level formula (weighted layer sum,
linear, mean over the utterance's frames, linear), so pooling first loses nothing and memory stays
utterances x layers x dim."""

import logging

import pytest
import torch

from contrastkit.evaluation.superb import Downstream

pytestmark = pytest.mark.quick


def test_pooled_downstream_equals_the_frame_level_formula():
    torch.manual_seed(0)
    layers, dim = 5, 12
    model = Downstream(layers, dim, {"speaker": 7, "action": 3}, proj=8).double()
    with torch.no_grad():
        model.layer_logits.normal_()
    utterances = [torch.randn(layers, frames, dim, dtype=torch.float64) for frames in (3, 11, 29)]
    logits = model(torch.stack([u.mean(1) for u in utterances]))
    weights = torch.softmax(model.layer_logits, 0)
    for i, frames in enumerate(utterances):
        per_frame = model.proj((weights[:, None, None] * frames).sum(0))  # [T, proj]
        pooled = per_frame.mean(0)
        for task, head in model.heads.items():
            torch.testing.assert_close(logits[task][i], head(pooled), rtol=1e-12, atol=1e-12)



def test_upstream_shows_transformers_load_report_only_where_encoder_weights_are_missing(tmp_path, caplog):
    """The recipe's upstream is a Wav2Vec2ForPreTraining: the evaluation keeps its encoder and leaves the heads
    out on purpose, so transformers' load report (which lists them) is not shown; with an encoder weight missing
    from the checkpoint it is."""
    from safetensors.torch import load_file, save_file

    from contrastkit.evaluation.superb import Upstream
    from contrastkit.speech.models import hf_model

    def shown():
        logger = logging.getLogger("transformers")  # transformers' records do not reach the root logger
        logger.addHandler(caplog.handler)
        try:
            Upstream(tmp_path, "cpu")
        finally:
            logger.removeHandler(caplog.handler)
        text = "\n".join(caplog.messages)
        caplog.clear()
        return text

    hf_model().save_pretrained(tmp_path)
    assert "quantizer" not in shown()
    weights = load_file(tmp_path / "model.safetensors")
    del weights["wav2vec2.encoder.layers.0.attention.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "encoder.layers.0.attention.k_proj.bias" in shown()  # transformers 5: its load report; 4.57: a warning
