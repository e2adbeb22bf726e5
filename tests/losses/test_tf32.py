"""TF32 products (torch.backends.cuda.matmul.allow_tf32, which open_clip_train turns on) must not make the
losses' paths (dense, blockwise, Triton) less accurate than a plain PyTorch loss under the same TF32: autograd
through the formula on the similarity matrix, as open_clip's ClipLoss computes InfoNCE. Emulated on CPU: every
matrix product's float32 operands are rounded to TF32's 10-bit mantissa (round to nearest), as tensor cores do."""

from __future__ import annotations

import contextlib

import pytest
import torch
from settings import call
from torch.utils._python_dispatch import TorchDispatchMode

from contrastkit.losses import build_loss
from reference import plain

aten = torch.ops.aten
# Products and the positions of their two matrix operands (backward's products included: dispatch level).
_PRODUCTS = {aten.mm.default: (0, 1), aten.mm.out: (0, 1), aten.addmm.default: (1, 2), aten.addmm_.default: (1, 2),
             aten.addmm.out: (1, 2), aten.bmm.default: (0, 1), aten.bmm.out: (0, 1)}


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to 1 + 10 mantissa bits, to nearest."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


class EmulateTF32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            args = list(args)
            for i in _PRODUCTS[func]:
                if args[i].dtype == torch.float32:
                    args[i] = to_tf32(args[i])
            self.products += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.quick
def test_emulation_rounds_to_tf32():
    x = torch.tensor([1.0 + 2**-11 + 2**-13, 1.0 + 2**-12, 3.0])
    assert to_tf32(x).tolist() == [1.0 + 2**-10, 1.0, 3.0]
    a = torch.full((1, 1), 1.0 + 2**-12)
    with EmulateTF32() as mode:
        assert (a @ a).item() == 1.0
    assert mode.products == 1


def _errors(name, setting, chunk, inputs, reference=None, backend="auto"):
    """Relative errors of the loss and every gradient against the float64 reference (or the results)."""
    dtype = torch.float64 if reference is None else torch.float32
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    fn = None if backend == "plain" else build_loss(name, chunk_size=chunk, backend=backend)
    with EmulateTF32() if reference is not None else contextlib.nullcontext():
        loss = plain(name, setting, leaves) if fn is None else call(fn, setting, leaves)
        grads = torch.autograd.grad(loss, leaves)
    results = [loss.detach().double(), *(g.double() for g in grads)]
    if reference is None:
        return results
    return [float((r - w).abs().max() / w.abs().max()) for r, w in zip(results, reference)]


CASES = [("infonce", "image_text_scale", 0.3), ("infonce", "image_text_scale", 3.0), ("dcl", "image_text_scale", 0.3),
         ("infonce", "two_views", 0.3), ("dcl", "two_views", 3.0), ("cacr", "two_views", 0.3)]


def _batch(setting, noise, n=1024):
    """``n`` pairs at cosines set by ``noise``, float64, the setting's tensors (tests/losses/settings.py);
    image-text with a learnable logit scale of 100. 1024 for the dense and blockwise paths: the plain loss's
    error in the loss and the scale's gradient, their bound, is a sum that comes out small by chance in
    smaller batches (at 512 the blockwise loss was 2.6 times twice it)."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(n, 64, generator=g, dtype=torch.float64)
    b = a + noise * torch.randn(n, 64, generator=g, dtype=torch.float64)
    return [a, b, torch.tensor(100.0, dtype=torch.float64)] if setting == "image_text_scale" else [a, b]


@pytest.mark.parametrize("name, setting, noise", CASES)
def test_dense_and_blockwise_within_plain_error_under_tf32(name, setting, noise):
    inputs = _batch(setting, noise)
    want = _errors(name, setting, 0, inputs)
    plain = _errors(name, setting, None, inputs, want, backend="plain")
    assert max(plain) > 1e-5  # the emulation is on: TF32 is far coarser than float32
    for chunk, backend in ((0, "dense"), (None, "torch"), (256, "torch")):
        ours = _errors(name, setting, chunk, inputs, want, backend=backend)
        for what, err, ref in zip(["loss", "grad a", "grad b", "grad scale"], ours, plain):
            assert err <= 2 * ref + 1e-6, f"{what}: {backend} {err:.2e} vs plain {ref:.2e} (chunk {chunk})"


# The loss and the scale's gradient of a batch whose positives dominate (p_ii ~ 1 at a logit scale of 100:
# the loss ~1e-21) carry the logits' absolute error as a relative one, which TF32 products (the plain loss)
# and float16 unit vectors throughout (the Triton path) spread differently: those two are held to TF32's
# 2^-11 four times over instead.
TF32_ROUNDING = 2**-9


@pytest.mark.parametrize("name, setting, noise", CASES)
def test_triton_within_dense_error_under_tf32(float32_precision, name, setting, noise):
    """The Triton path with TF32 allowed runs on float16 unit vectors (triton_stats.HALF_UNITS_FOR_TF32), its
    positives from the same units: the features' gradients within twice the dense loss's error under emulated
    TF32, the loss and the scale's gradient within that or TF32_ROUNDING. 256 pairs (the interpreter's cost is
    per tile: 2 row tiles of 128, two views' 4): the same route as 1024's (dense logits, float16 units) and the
    same margins (the features' gradients at 0.47-0.52 of their bound, 0.48-0.59 at 1024)."""
    inputs = _batch(setting, noise, n=256)
    want = _errors(name, setting, 0, inputs)
    plain = _errors(name, setting, None, inputs, want, backend="plain")
    torch.backends.cuda.matmul.allow_tf32 = True
    triton = _errors(name, setting, None, inputs, want, backend="triton")
    for what, err, ref in zip(["loss", "grad a", "grad b", "grad scale"], triton, plain):
        slack = TF32_ROUNDING if what in ("loss", "grad scale") else 1e-6
        assert err <= 2 * ref + slack, f"{what}: Triton {err:.2e} vs plain {ref:.2e}"


def test_positive_cosines_of_float16_units():
    """row_cosines(units16=True), the Triton path's positives under TF32: the cosines of the unit vectors rounded
    to float16 as the kernels' operands are (functional.half_units), in float32 sums, and their gradient the
    float64 one straight through the rounding (F.normalize's backward of the other's rounded unit vector); a
    zero row (its norm clamped to eps) gets no projection, as F.normalize's constant divisor."""
    from contrastkit.losses.functional import half_units, inverse_norms, row_cosines

    g = torch.Generator().manual_seed(8)
    a, b = (torch.randn(50, 24, generator=g) * torch.rand(50, 1, generator=g) * 5 for _ in range(2))
    a[3] = 0.0
    rounded = [half_units(x, inverse_norms(x)).double() for x in (a, b)]
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    got = row_cosines(*leaves, units16=True)
    leaves64 = [a.double().requires_grad_(), b.double().requires_grad_()]
    units = [u + (r - u).detach() for u, r in zip((torch.nn.functional.normalize(x, dim=1) for x in leaves64), rounded)]
    want = (units[0] * units[1]).sum(1)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert not torch.equal(got, row_cosines(a, b))  # the rounding is there: float32 units differ
    w = torch.randn(50, generator=g, dtype=torch.float64)
    for grad, want_grad in zip(torch.autograd.grad((got * w.float()).sum(), leaves),
                               torch.autograd.grad((want * w).sum(), leaves64)):
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_autocast_positives_from_the_bf16_features():
    """Under bf16 autocast the Triton path's products take bf16 copies of float32 features; its positives are
    the cosines of the same copies, so that the loss is the float64 loss of the bf16-rounded features to 1e-4
    (1.2e-5 measured; from the float32 features: 6.0e-3) and its gradients to 6e-3 (3.3e-3 and 4.3e-3; 1.2e-2
    and 1.3e-2), in a batch whose positives dominate (logit scale 100)."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(512, 64, generator=g)
    b = a + 0.3 * torch.randn(512, 64, generator=g)
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = build_loss("infonce", backend="triton").cross_modal(*leaves, logit_scale=torch.tensor(100.0))
    rounded = [a.bfloat16().double().requires_grad_(), b.bfloat16().double().requires_grad_()]
    want = build_loss("infonce").cross_modal(*rounded, logit_scale=torch.tensor(100.0, dtype=torch.float64))
    assert float((loss.double() - want).abs() / want.abs()) <= 1e-4
    for grad, want_grad in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(want, rounded)):
        assert float((grad.double() - want_grad).abs().max() / want_grad.abs().max()) <= 6e-3
