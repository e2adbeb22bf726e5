"""The fairseq2 wav2vec 2.0 adapter: InfoNCE equals fairseq2's own loss, the other objectives equal the
core kernels on its logits, frames without a valid distractor, patch/unpatch."""

from __future__ import annotations

import pytest
import torch

from contrastkit.adapters import fairseq2_wav2vec2 as adapter
from contrastkit.losses import functional as K
from contrastkit.speech.models import fairseq2_model

from environments import WHERE  # noqa: E402

pytest.importorskip("fairseq2", reason=f"fairseq2 0.8.1 pins torch 2.9.1, not installed here: {WHERE}")
from fairseq2.nn import BatchLayout  # noqa: E402


pytestmark = [pytest.mark.legacy, pytest.mark.usefixtures("one_thread")]


def _batch(seed=0):
    x = torch.randn(3, 9600, generator=torch.Generator().manual_seed(seed))
    return x, BatchLayout.of(x, [9600, 9000, 8000])


def _run(model, x, layout, seed=1):
    torch.manual_seed(seed)  # masking, distractor sampling and gumbel noise draw from torch's RNG
    return model(x, layout)


@pytest.mark.parametrize("entries", [32, 2])
def test_infonce_equals_fairseq2_loss(entries):
    model = fairseq2_model(num_codebooks=1 if entries == 2 else 2, num_codebook_entries=entries)
    x, layout = _batch()
    own, own_out = _run(model, x, layout)
    with adapter.patch(model, loss="infonce"):
        assert adapter.active_objective(model).name == "infonce"
        ours, out = _run(model, x, layout)
    if entries == 2:
        assert not bool(torch.isfinite(out.logits).all())  # some distractors equal their target
    torch.testing.assert_close(ours.contrastive, own.contrastive, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.aggregate, own.aggregate, rtol=1e-6, atol=1e-5)
    assert adapter.active_objective(model) is None


@pytest.mark.parametrize("loss,options", [("dcl", {}), ("dclw", {}), ("eqco", {"alpha": 50.0}), ("cacr", {})])
def test_objectives_equal_core_kernels_on_fairseq2_logits(loss, options):
    model = fairseq2_model(num_codebooks=1, num_codebook_entries=4)
    x, layout = _batch(2)
    with adapter.patch(None, loss=loss, **options):  # the class
        result, out = _run(model, x, layout)
    logits = out.logits.transpose(0, 1).reshape(-1, out.logits.shape[-1]).float()
    valid = torch.isfinite(logits[:, 1:])
    keep = valid.any(1)
    tau = model.logit_temp
    kw = dict(options) if loss == "cacr" else {"temperature": tau, **options}
    expected = getattr(K, loss)((logits[:, 0] * tau)[keep], (logits[:, 1:] * tau).masked_fill(~valid, 0)[keep],
                                neg_mask=valid[keep], **kw).sum()
    torch.testing.assert_close(result.contrastive, expected, rtol=1e-5, atol=1e-4)
    result.aggregate.backward()


def test_frames_without_valid_distractor_and_errors():
    model = fairseq2_model(num_codebooks=1, num_codebook_entries=1)  # every distractor equals its target
    x, layout = _batch()
    own, _ = _run(model, x, layout)
    assert float(own.contrastive.detach()) == 0.0
    with adapter.patch(model, loss="dcl"):
        ours, out = _run(model, x, layout)
        assert float(ours.contrastive.detach()) == 0.0
        assert model._contrastkit_dropped_frames == out.logits.shape[0] * out.logits.shape[1]
    with pytest.raises(TypeError, match="Wav2Vec2Model"):
        adapter.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unsupported loss"):
        adapter.patch(model, loss="unigrad")
