"""The typed loss API: explicit settings, reduction="mean" | "sum" | "none" against float64 references,
clear errors where an objective has no form, build_loss's types, and the peers' defaults."""

from __future__ import annotations

import inspect
import re
import typing
import warnings

import pytest
import torch

import reference
from contrastkit.losses import (CACRLoss, ContrastiveLoss, Objective, UniGradLoss, available_losses, build_loss,
                                registry)

pytestmark = pytest.mark.quick

SCORE = {"infonce": {"tau": 0.1}, "dcl": {"tau": 0.1}, "dclw": {"tau": 0.1, "sigma": 0.5},
         "eqco": {"tau": 0.1, "alpha": 256.0}, "cacr": {"t_pos": 1.0, "t_neg": 2.0}}
SHARED = {"normalize", "reduction"}
CONTRASTIVE = SHARED | {"gather_distributed", "chunk_size", "backend", "same_label"}


def _views(seed, n, d, v=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(v)]


def _weights(seed, m):
    return torch.rand(m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5


@pytest.mark.parametrize("kind", list(SCORE))
@pytest.mark.parametrize("chunk_size", [None, 3, 0])
def test_reduction_none_gives_each_anchors_loss_and_its_gradient(kind, chunk_size):
    """Per-anchor losses, view-major, and the gradient of a non-uniform weighting of them (sample
    weights: the blockwise kernel's closed-form guess is then wrong and must be corrected)."""
    z = _views(hash((kind, chunk_size)) % 2**31, 5, 6, v=3)
    got = build_loss(kind, reduction="none", chunk_size=chunk_size)(*z)
    expected = reference.per_anchor(z, kind, mean=False, **SCORE[kind])
    assert got.shape == (15,)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    w = _weights(1, 15)
    for g, e in zip(torch.autograd.grad((w * got).sum(), z), torch.autograd.grad((w * expected).sum(), z)):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("kind", list(SCORE))
def test_reduction_sum_is_the_sum_of_the_anchors(kind):
    z = _views(7, 6, 5)
    got = build_loss(kind, reduction="sum")(*z)
    expected = reference.per_anchor(z, kind, mean=False, **SCORE[kind]).sum()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(torch.autograd.grad(got, z), torch.autograd.grad(expected, z)):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("kind", ["infonce", "dcl"])
@pytest.mark.parametrize("chunk_size", [None, 0])
def test_reduction_none_in_the_query_key_and_image_text_settings(kind, chunk_size):
    q, k, queue = _views(8, 6, 5, v=3)
    loss_fn = build_loss(kind, reduction="none", chunk_size=chunk_size)
    expected = reference.query_key(q, k, queue, kind, mean=False, tau=0.1)
    torch.testing.assert_close(loss_fn.query_key(q, k, queue), expected, rtol=1e-10, atol=1e-12)

    img, txt = _views(9, 6, 5)
    u, w = reference.unit(img), reference.unit(txt)
    losses = []  # images' anchors, then texts'
    for a, b in ((u, w), (w, u)):
        for i in range(6):
            cands = [j for j in range(6) if kind == "infonce" or j != i]
            losses.append(-(a[i] @ b[i]) / 0.1 + torch.log(torch.exp(b[cands] @ a[i] / 0.1).sum()))
    expected = torch.stack(losses)
    got = loss_fn.cross_modal(img, txt)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    weights = _weights(2, 12)
    for g, e in zip(torch.autograd.grad((weights * got).sum(), (img, txt)),
                    torch.autograd.grad((weights * expected).sum(), (img, txt))):
        torch.testing.assert_close(g, e, rtol=1e-7, atol=1e-10)


def test_unigrad_reduction_none_per_anchor():
    z1, z2 = _views(10, 6, 4)
    loss_fn = UniGradLoss(lam=10.0, reduction="none")
    got = loss_fn(z1, z2)
    expected = reference.unigrad(z1, z2, loss_fn.correlation.double(), 10.0, mean=False)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", available_losses())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_output_dict_is_reduced_like_the_loss(name, reduction):
    z = _views(11, 5, 4)
    loss_fn = build_loss(name, reduction=reduction)
    out = loss_fn(*z, output_dict=True)
    plain = build_loss(name, reduction=reduction)(*z)
    torch.testing.assert_close(out["loss"], plain, rtol=1e-12, atol=0)
    mean_out = build_loss(name)(*z, output_dict=True)
    for key, value in out.items():
        assert value.shape == plain.shape, key
        scale = {"mean": 1.0, "sum": 10.0, "none": None}[reduction]
        if scale is not None:
            torch.testing.assert_close(value.detach(), scale * mean_out[key].detach(), rtol=1e-12, atol=1e-12)
        else:
            torch.testing.assert_close(value.detach().mean(), mean_out[key].detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", available_losses())
def test_bad_reduction_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"{name}: reduction must be one of mean, sum, none, got 'avg'"):
        build_loss(name, reduction="avg")


def test_unigrad_says_it_has_no_query_key_or_image_text_form():
    loss_fn = build_loss("unigrad")
    z1, z2 = _views(12, 4, 3)
    with pytest.raises(ValueError, match="unigrad has no query/key"):
        loss_fn.query_key(z1, z2)
    with pytest.raises(ValueError, match="unigrad has no image-text"):
        loss_fn.cross_modal(z1, z2)
    with pytest.raises(TypeError, match="build_loss\\('unigrad'\\).*chunk_size"):
        build_loss("unigrad", chunk_size=0)


@pytest.mark.parametrize("name", available_losses())
def test_every_setting_is_an_explicit_keyword(name):
    cls = registry.LOSSES[name]
    params = inspect.signature(cls).parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"{name} hides settings in **kwargs"
    keywords = {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == (CONTRASTIVE if issubclass(cls, ContrastiveLoss) else SHARED)
    loss_fn = cls(normalize=False, reduction="sum")
    assert isinstance(loss_fn, Objective) and not loss_fn.normalize and loss_fn.reduction == "sum"
    assert not hasattr(loss_fn, "logit_scale")  # the argument of cross_modal; the method is default_logit_scale


def test_build_loss_is_typed_per_name():
    returns = {}
    for overload in typing.get_overloads(registry.build_loss):
        hints = typing.get_type_hints(overload, vars(registry))
        arg = typing.get_args(hints["name"])
        returns[arg[0] if arg else "any"] = hints["return"]
    assert returns == {**registry.LOSSES, "any": Objective}
    assert typing.get_type_hints(registry.build_loss, vars(registry))["return"] is Objective


def test_default_logit_scale():
    assert build_loss("dcl", temperature=0.25).default_logit_scale() == 4.0
    assert CACRLoss(t_neg=3.0).default_logit_scale() == 6.0


def test_the_migration_tables_equivalences():
    """docs/objectives.md, "Coming from lightly, open_clip or Hugging Face": the same numbers from its settings."""
    lightly_loss = pytest.importorskip("lightly.loss")
    open_clip = pytest.importorskip("open_clip")
    z1, z2 = (z.detach() for z in _views(13, 16, 8))
    torch.testing.assert_close(build_loss("infonce", temperature=0.5)(z1, z2), lightly_loss.NTXentLoss()(z1, z2))
    assert not torch.allclose(build_loss("infonce")(z1, z2), lightly_loss.NTXentLoss()(z1, z2))  # 0.1 vs 0.5
    torch.testing.assert_close(build_loss("dcl")(z1, z2), lightly_loss.DCLLoss()(z1, z2))
    with warnings.catch_warnings():  # lightly's DCLW weights copy-construct a tensor
        warnings.simplefilter("ignore", UserWarning)
        expected = lightly_loss.DCLWLoss()(z1, z2)
    torch.testing.assert_close(build_loss("dclw")(z1, z2), expected)
    scale = torch.tensor(14.3, dtype=torch.float64)
    u1, u2 = (torch.nn.functional.normalize(z, dim=-1) for z in (z1, z2))
    torch.testing.assert_close(build_loss("infonce").cross_modal(z1, z2, logit_scale=scale),
                               open_clip.ClipLoss()(u1, u2, scale))


def test_repr_shows_the_settings():
    """As torch's modules show theirs: the objective's own, gathering and the labels' mode, the rest where set."""
    assert repr(build_loss("dcl")) == "DCLLoss(temperature=0.1, gather_distributed=False, same_label='mask')"
    assert repr(build_loss("dclw", 0.2, sigma=1.0, gather_distributed=True, same_label="positive")) == (
        "DCLWLoss(temperature=0.2, sigma=1.0, gather_distributed=True, same_label='positive')")
    assert repr(build_loss("eqco", alpha=64.0, reduction="none", chunk_size=0)) == (
        "EqCoLoss(temperature=0.1, alpha=64.0, gather_distributed=False, chunk_size=0, reduction='none', "
        "same_label='mask')")
    assert repr(build_loss("cacr", backend="torch")) == (
        "CACRLoss(t_pos=1.0, t_neg=2.0, gather_distributed=False, backend='torch', same_label='mask')")
    assert repr(build_loss("unigrad", normalize=False)) == "UniGradLoss(lam=100.0, rho=0.99, normalize=False)"
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), build_loss("infonce", 0.5, gather_distributed="uneven"))
    assert "(1): InfoNCELoss(temperature=0.5, gather_distributed='uneven', same_label='mask')" in str(model)


def test_unknown_keywords_are_named_together_with_what_to_use():
    with pytest.raises(TypeError) as err:
        build_loss("dcl", memory_bank_size=(4096, 128), weight_fn=None, sigmaa=0.5)
    message = str(err.value)
    assert message.startswith("build_loss('dcl'): DCLLoss got unexpected keyword arguments 'memory_bank_size', "
                              "'weight_fn', 'sigmaa' (")
    assert "query_key(query, key, queue)" in message and "build_loss('dclw', sigma=0.5)" in message
    assert message.endswith("; it takes temperature, normalize, gather_distributed, chunk_size, backend, reduction, "
                            "same_label")
    for keyword, hint in [("local_loss", "is gather_distributed=True"), ("gather_with_grad", "ContrastkitClipLoss"),
                          ("cache_labels", "drop it"), ("scale", "temperature=0.05"), ("tau", "temperature=")]:
        with pytest.raises(TypeError, match=re.escape(f"argument '{keyword}' ({keyword}: ") + f".*{re.escape(hint)}"):
            build_loss("infonce", **{keyword: 1})
    with pytest.raises(TypeError, match=re.escape("'sigma' (sigma: an option of dclw, not of dcl)")):
        build_loss("dcl", sigma=0.5)
    with pytest.raises(TypeError, match=re.escape("(temperature: an option of infonce, dcl, dclw, eqco, not of cacr)")):
        build_loss("cacr", temperature=0.1)
    with pytest.raises(TypeError, match=re.escape("UniGradLoss got unexpected keyword argument 'gather_distributed' "
                                                  "(gather_distributed: an option of infonce, dcl, dclw, eqco, cacr")):
        build_loss("unigrad", gather_distributed=True)
    # each hint is for a keyword no objective takes: one that some took would never be shown
    taken = {k for cls in registry.LOSSES.values() for k in inspect.signature(cls).parameters}
    assert not taken & set(registry.FOREIGN_KEYWORDS)


def test_other_libraries_names_say_which_call_to_use():
    for name in ("ntxent", "NTXentLoss", "nt_xent", "NT-Xent"):
        with pytest.raises(ValueError, match=re.escape(f"unknown loss {name!r} (lightly's NTXentLoss is InfoNCE at "
                                                       "temperature 0.5 by default: build_loss('infonce', "
                                                       "temperature=0.5) is the same value, build_loss('dcl')")):
            build_loss(name)
    with pytest.raises(ValueError, match=re.escape("sentence_transformers.MultipleNegativesLoss(model, "
                                                   "loss='infonce')")):
        build_loss("MultipleNegativesRankingLoss")
    with pytest.raises(ValueError, match=re.escape("build_loss('infonce').cross_modal(image, text, logit_scale=")):
        build_loss("ClipLoss")
    with pytest.raises(ValueError, match="^unknown loss 'nope'; choose one of infonce, dcl, dclw, eqco, cacr, unigrad$"):
        build_loss("nope")
    with pytest.raises(ValueError, match="unknown loss 'NTXentLoss' \\(lightly's"):
        registry.objective_options("NTXentLoss", temperature=0.5)


def test_class_names_and_positional_arguments_as_the_classes_take_them():
    for name, cls in registry.LOSSES.items():
        assert type(build_loss(cls.__name__)) is cls and type(build_loss(cls.__name__.upper())) is cls
    assert build_loss("dcl", 0.5).temperature == 0.5
    dclw = build_loss("DCLWLoss", 0.2, 0.3)
    assert (dclw.temperature, dclw.sigma) == (0.2, 0.3)
    assert build_loss("cacr", 0.5).t_pos == 0.5 and build_loss("unigrad", 10.0).lam == 10.0
    assert registry.objective_options("DCLWLoss", temperature=0.2, sigma=0.3, alpha=4.0) == {"temperature": 0.2,
                                                                                             "sigma": 0.3}
    with pytest.raises(TypeError, match="build_loss\\('dcl'\\): .*multiple values for argument 'temperature'"):
        build_loss("dcl", 0.1, temperature=0.2)
