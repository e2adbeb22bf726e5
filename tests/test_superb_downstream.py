"""The SUPERB downstream on per-utterance frame means equals the frame-level formula (weighted layer sum,
linear, mean over the utterance's frames, linear), so pooling first loses nothing and memory stays
utterances x layers x dim."""

import torch

from contrastkit.evaluation.superb import Downstream


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
