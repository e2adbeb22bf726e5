"""The Hugging Face wav2vec 2.0 adapter: InfoNCE equals the model's own loss, the other objectives equal
the core kernels on the model's logits, patch/unpatch, one import, frames without a valid distractor,
2 processes equal 1; the tests marked legacy run on transformers 4.57 too (the second environment)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from launch import end_process_group, fork_ranks

from contrastkit.adapters import hf_wav2vec2
from contrastkit.losses import functional as K
from contrastkit.speech.models import hf_mask_and_negatives, hf_model

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(model, seed=0, batch=3, samples=6400):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, samples, generator=g)
    mask, neg = hf_mask_and_negatives(model, batch, samples, np.random.default_rng(seed))
    return x, mask, neg


def _run(model, x, mask, neg, seed=1, **kw):
    torch.manual_seed(seed)  # the gumbel noise of the quantiser
    return model(x, mask_time_indices=mask, sampled_negative_indices=neg, **kw)


def _model_logits(model, out, neg_idx, mask):
    """The logits exactly as the model builds them (its own compute_contrastive_logits and masking),
    restricted to masked frames: [M, 1 + K], -inf where a distractor equals the target."""
    q, c = out.projected_quantized_states, out.projected_states
    b, t, h = q.shape
    negs = q.reshape(-1, h)[neg_idx.reshape(-1)].view(b, t, -1, h).permute(2, 0, 1, 3)
    logits = model.compute_contrastive_logits(q[None], negs, c, model.config.contrastive_logits_temperature)
    neg_is_pos = (q == negs).all(-1)
    logits[1:][neg_is_pos] = float("-inf")
    return logits.permute(1, 2, 0)[mask.bool()]


@pytest.mark.quick
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
@pytest.mark.parametrize("conformer", [False, True])
@pytest.mark.parametrize("codevectors", [32, 2])  # 2 codevectors: many distractors equal their target
def test_infonce_equals_model_loss(conformer, codevectors):
    model = hf_model(conformer, num_codevectors_per_group=codevectors, num_codevector_groups=1 if codevectors == 2 else 2)
    model.train()
    x, mask, neg = _batch(model)
    own = _run(model, x, mask, neg)
    with hf_wav2vec2.patch(model, loss="infonce"):
        ours = _run(model, x, mask, neg)
    assert type(ours) is type(own)
    torch.testing.assert_close(ours.contrastive_loss, own.contrastive_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.loss, own.loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours.diversity_loss, own.diversity_loss, rtol=0, atol=0)
    # and the gradients
    grads = []
    for patched in (False, True):
        model.zero_grad()
        handle = hf_wav2vec2.patch(model, loss="infonce") if patched else None
        _run(model, x, mask, neg).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        if handle:
            handle.undo()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("loss,options", [("dcl", {}), ("dcl", {"temperature": 0.2}), ("dclw", {"sigma": 0.5}),
                                          ("eqco", {"alpha": 64.0}), ("cacr", {})])
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
def test_objectives_equal_core_kernels_on_model_logits(loss, options):
    model = hf_model(num_codevectors_per_group=4, num_codevector_groups=1)  # some distractors masked
    x, mask, neg = _batch(model, seed=3)
    with hf_wav2vec2.patch(model, loss=loss, **options):
        out = _run(model, x, mask, neg)
    logits = _model_logits(model, out, neg, mask)
    tau = model.config.contrastive_logits_temperature
    pos, negs = logits[:, 0] * tau, logits[:, 1:] * tau  # back to cosines
    valid = torch.isfinite(logits[:, 1:])
    assert not bool(valid.all()), "the test wants some masked distractors"
    keep = valid.any(1)
    kernel = getattr(K, loss)
    kw = dict(options)
    if loss != "cacr":
        kw.setdefault("temperature", tau)
    expected = kernel(pos[keep], negs[keep].masked_fill(~valid[keep], 0.0), neg_mask=valid[keep], **kw).sum()
    torch.testing.assert_close(out.contrastive_loss, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.loss, expected + model.config.diversity_loss_weight * out.diversity_loss,
                               rtol=1e-5, atol=1e-4)
    if loss == "dcl":  # DCL leaves the positive out of the denominator: below InfoNCE frame by frame
        assert out.contrastive_loss < K.infonce(pos[keep], negs[keep].masked_fill(~valid[keep], 0.0),
                                                neg_mask=valid[keep], temperature=kw["temperature"]).sum()


@pytest.mark.quick
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
def test_frames_without_valid_distractor():
    """One codevector: every distractor equals its target. The model's InfoNCE is 0 for such frames;
    the adapter leaves them out of the sum for every objective (0, never an error or NaN)."""
    model = hf_model(num_codevectors_per_group=1, num_codevector_groups=1)
    x, mask, neg = _batch(model)
    own = _run(model, x, mask, neg)
    assert float(own.contrastive_loss.detach()) == 0.0
    for loss in ("infonce", "dcl", "dclw", "eqco", "cacr"):
        with hf_wav2vec2.patch(model, loss=loss):
            out = _run(model, x, mask, neg)
            assert float(out.contrastive_loss.detach()) == 0.0
            assert model._contrastkit_dropped_frames == int(mask.sum())
            out.loss.backward()  # stays differentiable (the diversity term)


@pytest.mark.quick
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
@pytest.mark.parametrize("loss", ["infonce", "dcl", "dclw", "eqco", "cacr"])
def test_frames_left_out_in_place(loss):
    """FrameObjective keeps every row (no shape from values, so no host sync on CUDA): the frames with no valid
    distractor, and the rows outside ``frames``, give exactly what leaving them out gives (loss, gradients:
    0 for theirs), DCLW's weights over the other frames only; ``dropped`` is a 0-dim tensor counting the first
    kind alone. Every frame left out: 0, with zero gradients."""
    from contrastkit.losses import functional
    from contrastkit.losses.frames import FrameObjective

    g = torch.Generator().manual_seed(5)
    pos = torch.rand(9, generator=g, dtype=torch.float64)
    neg = torch.rand(9, 6, generator=g, dtype=torch.float64)
    valid = torch.rand(9, 6, generator=g) > 0.4
    valid[:, 0] = True
    valid[[1, 4, 7]] = False  # three frames without a valid distractor
    neg[1, 2] = float("inf")  # a dropped frame's scores are never looked at
    frames = torch.ones(9, dtype=torch.bool)
    frames[[0, 7]] = False  # rows that are not frames to contrast (7 would be dropped too)
    objective = FrameObjective(loss, **({"sigma": 0.3} if loss == "dclw" else {}))
    for rows in (None, frames):
        leaves = [pos.clone().requires_grad_(), neg.clone().requires_grad_()]
        total, dropped = objective.summed(*leaves, valid, model_temperature=0.2, frames=rows)
        grads = torch.autograd.grad(total, leaves)
        keep = valid.any(1) & (True if rows is None else rows)
        want_leaves = [pos[keep].requires_grad_(), neg[keep].requires_grad_()]
        kernel, options = getattr(functional, loss), dict(objective.options)  # functional's own score kernel
        if loss != "cacr":
            options["temperature"] = 0.2
        want = kernel(*want_leaves, neg_mask=valid[keep], **options).sum()  # DCLW: weights over kept frames
        want_grads = torch.autograd.grad(want, want_leaves)
        torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got[keep], expected, rtol=1e-12, atol=1e-12)
            assert bool((got[~keep] == 0).all())
        assert isinstance(dropped, torch.Tensor) and dropped.dim() == 0
        assert int(dropped) == (3 if rows is None else 2)
    leaves = [pos.clone().requires_grad_(), neg.clone().requires_grad_()]
    total, dropped = objective.summed(*leaves, torch.zeros_like(valid), model_temperature=0.2)
    total.backward()
    assert float(total.detach()) == 0.0 and int(dropped) == 9
    assert all(bool((t.grad == 0).all()) for t in leaves)


@pytest.mark.quick
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
def test_patch_targets_and_undo():
    from transformers import Wav2Vec2ConformerForPreTraining, Wav2Vec2ForPreTraining

    original = Wav2Vec2ForPreTraining.forward
    a, b = hf_model(), hf_model()
    x, mask, neg = _batch(a)
    base = _run(a, x, mask, neg).loss

    handle = hf_wav2vec2.patch(a, loss="dcl")  # one instance
    assert hf_wav2vec2.active_objective(a).name == "dcl" and hf_wav2vec2.active_objective(b) is None
    assert _run(a, x, mask, neg).loss < base
    handle.undo()
    torch.testing.assert_close(_run(a, x, mask, neg).loss, base)

    with hf_wav2vec2.patch(Wav2Vec2ForPreTraining, loss="cacr"):  # a class: existing and new instances
        assert hf_wav2vec2.active_objective(b).name == "cacr"
        assert hf_wav2vec2.active_objective(hf_model(conformer=True)) is None
    assert Wav2Vec2ForPreTraining.forward is original

    with hf_wav2vec2.patch(None, loss="dclw", sigma=1.0) as h:  # every supported class
        assert {type(t) for t in h.targets} == {type}
        assert hf_wav2vec2.active_objective(hf_model(conformer=True)).options == {"sigma": 1.0}
        hf_wav2vec2.patch(None, loss="eqco")  # patching again replaces the objective
        assert hf_wav2vec2.active_objective(a).name == "eqco"
        # return_dict=False keeps the model's own tuple layout
        tup = _run(a, x, mask, neg, return_dict=False)
        assert isinstance(tup, tuple) and len(tup) == 4
    assert Wav2Vec2ForPreTraining.forward is original
    assert "forward" not in Wav2Vec2ConformerForPreTraining.__dict__ or \
        not hasattr(Wav2Vec2ConformerForPreTraining.forward, "__contrastkit_original__")
    # no negatives: no loss, the model's own output
    assert a(x).loss is None


@pytest.mark.quick
def test_bad_arguments():
    with pytest.raises(ValueError, match="UniGrad has no distractor form"):
        hf_wav2vec2.patch(None, loss="unigrad")
    with pytest.raises(ValueError, match="unknown"):
        hf_wav2vec2.patch(None, loss="dcl", sigma=0.5)
    with pytest.raises(TypeError, match="not a wav2vec 2.0 pre-training model"):
        hf_wav2vec2.patch(torch.nn.Linear(2, 2))
    model = hf_model()
    x, mask, neg = _batch(model)
    with hf_wav2vec2.patch(model), pytest.raises(ValueError, match="needs mask_time_indices"):
        model(x, sampled_negative_indices=neg)


@pytest.mark.quick
@pytest.mark.parametrize("env,message", [
    ({"CONTRASTKIT_TEMPERATURE": "abc"}, "CONTRASTKIT_TEMPERATURE='abc' is not a number"),
    ({"CONTRASTKIT_TEMPERATURE": "0"}, "CONTRASTKIT_TEMPERATURE='0': the temperature must be a positive"),
    ({"CONTRASTKIT_TEMPERATURE": "-1"}, "CONTRASTKIT_TEMPERATURE='-1'"),
    ({"CONTRASTKIT_LOSS": "unigrad"}, "CONTRASTKIT_LOSS='unigrad': .*UniGrad has no distractor form"),
])
def test_one_import_rejects_a_bad_environment_at_import(monkeypatch, env, message):
    """Checked at import, before any preprocessing, with the variable's name in the message."""
    import importlib

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    sys.modules.pop("contrastkit.adapters.hf_wav2vec2_dcl", None)
    with pytest.raises(ValueError, match=message):
        importlib.import_module("contrastkit.adapters.hf_wav2vec2_dcl")
    sys.modules.pop("contrastkit.adapters.hf_wav2vec2_dcl", None)
    assert hf_wav2vec2.active_objective(hf_model()) is None
    monkeypatch.delenv(next(iter(env)))
    monkeypatch.setenv("CONTRASTKIT_TEMPERATURE", "0.3")
    module = importlib.import_module("contrastkit.adapters.hf_wav2vec2_dcl")
    try:
        assert hf_wav2vec2.active_objective(hf_model()).options == {"temperature": 0.3}
    finally:
        module.PATCH.undo()
        sys.modules.pop("contrastkit.adapters.hf_wav2vec2_dcl", None)


@pytest.mark.quick
@pytest.mark.legacy  # the adapters promise transformers 4.57 too
@pytest.mark.parametrize("order", ["patch_then_prepare", "prepare_then_patch"])
def test_patch_survives_accelerate_bf16_in_either_order(order):
    """accelerate's mixed precision wraps the instance's forward in autocast: patching (before or after)
    leaves that wrapper working, and undo leaves it in place."""
    from accelerate import Accelerator

    model = hf_model()
    x, mask, neg = _batch(model)
    dtypes = []
    model.wav2vec2.encoder.layers[0].feed_forward.intermediate_dense.register_forward_hook(
        lambda m, i, o: dtypes.append(o.dtype))
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    if order == "patch_then_prepare":
        handle = hf_wav2vec2.patch(model, loss="dcl")
        prepared = accelerator.prepare(model)
    else:
        prepared = accelerator.prepare(model)
        handle = hf_wav2vec2.patch(prepared, loss="dcl")
    out = _run(prepared, x, mask, neg)
    assert dtypes[-1] == torch.bfloat16, "accelerate's autocast is gone"
    assert hf_wav2vec2.active_objective(prepared).name == "dcl"
    pos, negs, valid = hf_wav2vec2.contrastive_scores(out.projected_states, out.projected_quantized_states, neg, mask)
    keep = valid.any(1)
    expected = K.dcl(pos[keep], negs[keep].masked_fill(~valid[keep], 0.0), neg_mask=valid[keep],
                     temperature=model.config.contrastive_logits_temperature).sum()
    torch.testing.assert_close(out.contrastive_loss, expected, rtol=1e-5, atol=1e-4)
    handle.undo()
    assert hf_wav2vec2.active_objective(prepared) is None
    _run(prepared, x, mask, neg)
    assert dtypes[-1] == torch.bfloat16, "undo removed accelerate's autocast"


# ----------------------------------------------------------------------------- 2 processes = 1 process


def _grads(model, x, mask, neg, lo, hi, loss, ddp=False):
    model.zero_grad()
    runner = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    with hf_wav2vec2.patch(runner, loss=loss):
        if ddp:
            assert hf_wav2vec2.active_objective(runner).name == loss  # seen through the DDP wrapper
        out = runner(x[lo:hi], mask_time_indices=mask[lo:hi], sampled_negative_indices=neg[lo:hi] - lo * mask.shape[1])
    out.contrastive_loss.backward()  # the diversity term is a batch statistic (perplexity), not per frame
    return float(out.contrastive_loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = hf_model().eval()  # eval: no gumbel noise, so halves and the whole batch see the same codes
    x, mask, neg = _batch(model, batch=4)
    results = {}
    for loss in ("dcl", "dclw"):
        # DDP averages the gradients over the processes
        results[loss] = _grads(model, x, mask, neg, 2 * rank, 2 * rank + 2, loss, ddp=True)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    end_process_group()


def test_two_processes_match_one(tmp_path):
    fork_ranks(_worker, (2, str(tmp_path / "init"), str(tmp_path)))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = hf_model().eval()
    x, mask, neg = _batch(model, batch=4)
    for loss in ("dcl", "dclw"):
        total, grads = _grads(model, x, mask, neg, 0, 4, loss)
        # summed contrastive losses: the halves add up; DDP averages, so 2 processes' gradient is half the sum's
        assert parts[0][loss][0] + parts[1][loss][0] == pytest.approx(total, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(parts[0][loss][1][name] * 2, g, rtol=1e-4, atol=1e-6)
