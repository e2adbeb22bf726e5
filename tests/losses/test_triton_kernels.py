"""A Triton kernel file on its own against torch (the whole op against float64 references:
test_triton_stats.py): the band's d logits (kernels/dlogits.py), which the op only reaches through the
products that read them. Under the interpreter on CPU, 16-wide tiles, ragged sizes."""

from __future__ import annotations

import pytest
import torch

from contrastkit.losses.triton import dlogits, launch

pytestmark = [pytest.mark.quick, pytest.mark.legacy]  # the kernels under triton 3.5.1 / torch 2.9.1 too

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("normalize", [False, True])
def test_band_dlogits_equal_torch(normalize):
    """Rows 5:30 of dL' for image-text (rows' and columns' terms, the diagonal excluded) written to a band
    buffer from the block's float32 products, and the rows' d scale terms, against the dense formula. normalize: the features as given (rows of
    norms 0.2 to 5) with their inverse norms: the logits are the unit vectors', dL' is written times
    inv_a inv_b and the d scale terms sum dL' times the cosines."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(37, 24, generator=g), torch.randn(37, 24, generator=g)
    if normalize:
        a, b = (x * torch.empty(37, 1).uniform_(0.2, 5.0, generator=g) for x in (a, b))
    inv_a, inv_b = (1.0 / x.double().norm(dim=1) if normalize else torch.ones(37, dtype=torch.float64) for x in (a, b))
    scale = torch.tensor(3.0)
    cos = (a.double() * inv_a[:, None]) @ (b.double() * inv_b[:, None]).T
    logits = scale * cos
    masked = logits - torch.diag(torch.full((37,), float("inf"), dtype=torch.float64))
    stats = torch.stack([masked.logsumexp(1), masked.logsumexp(0)]).float()
    grad = torch.rand(2, 37, generator=g)
    want = (torch.exp(masked - stats[0, :, None].double()) * grad[0, :, None]
            + torch.exp(masked - stats[1, None, :].double()) * grad[1, None, :])
    splits, share = launch.split(2, 37, torch.device(DEVICE))
    band = torch.full((40, 37), float("nan"), device=DEVICE)  # the block: rows 5:30, columns 3:35
    ds = torch.zeros(splits, 25, device=DEVICE)  # the block's rows
    exclude = torch.arange(37, device=DEVICE)[:, None]
    a, b, scale, stats, grad = (t.to(DEVICE) for t in (a, b, scale, stats, grad))
    norms = (inv_a.float().to(DEVICE), inv_b.float().to(DEVICE)) if normalize else None
    inputs = launch.KernelInputs(scale, exclude, False, True, False, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=16), norms)
    products = (a @ b.T)[5:30, 3:35].contiguous()  # the block's, as cuBLAS writes them (float32)
    dlogits.write_dlogits(a, b, inputs, stats, grad, band, ds, 5, 30, 3, 35, splits, share, products)
    written = want * inv_a[:, None] * inv_b[None, :]
    torch.testing.assert_close(band[:25, :32].double().cpu(), written[5:30, 3:35], rtol=1e-5, atol=1e-6)
    assert torch.isnan(band[25:]).all() and torch.isnan(band[:, 32:]).all()  # nothing past the block
    want_ds = (want[5:30, 3:35] * cos[5:30, 3:35]).sum(1)
    torch.testing.assert_close(ds.sum(0).double().cpu(), want_ds, rtol=1e-5, atol=1e-5)
