"""TF32 products (torch.backends.cuda.matmul.allow_tf32, which open_clip_train turns on) must not make the
blockwise kernels less accurate than the dense loss under the same TF32. Emulated on CPU: every matrix
product's float32 operands are rounded to TF32's 10-bit mantissa (round to nearest), as tensor cores do."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from contrastkit.losses import build_loss

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


def test_emulation_rounds_to_tf32():
    x = torch.tensor([1.0 + 2**-11 + 2**-13, 1.0 + 2**-12, 3.0])
    assert to_tf32(x).tolist() == [1.0 + 2**-10, 1.0, 3.0]
    a = torch.full((1, 1), 1.0 + 2**-12)
    with EmulateTF32() as mode:
        assert (a @ a).item() == 1.0
    assert mode.products == 1


def _errors(name, setting, chunk, inputs, reference=None):
    """Relative errors of the loss and every gradient against the float64 reference (or the results)."""
    dtype = torch.float64 if reference is None else torch.float32
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
    fn = build_loss(name, chunk_size=chunk)
    with EmulateTF32() if reference is not None else contextlib.nullcontext():
        if setting == "image_text":
            loss = fn.cross_modal(leaves[0], leaves[1], logit_scale=leaves[2])
        else:
            loss = fn(leaves[0], leaves[1])
        grads = torch.autograd.grad(loss, leaves)
    results = [loss.detach().double(), *(g.double() for g in grads)]
    if reference is None:
        return results
    return [float((r - w).abs().max() / w.abs().max()) for r, w in zip(results, reference)]


@pytest.mark.parametrize("name, setting, noise", [("infonce", "image_text", 0.3), ("infonce", "image_text", 3.0),
                                                  ("dcl", "image_text", 0.3), ("infonce", "two_views", 0.3),
                                                  ("dcl", "two_views", 3.0), ("cacr", "two_views", 0.3)])
def test_blockwise_within_dense_error_under_tf32(name, setting, noise):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(1024, 64, generator=g, dtype=torch.float64)
    b = a + noise * torch.randn(1024, 64, generator=g, dtype=torch.float64)
    inputs = [a, b, torch.tensor(100.0 if setting == "image_text" else 1.0, dtype=torch.float64)]
    inputs = inputs if setting == "image_text" else inputs[:2]
    want = _errors(name, setting, 0, inputs)
    dense = _errors(name, setting, 0, inputs, want)
    assert max(dense) > 1e-5  # the emulation is on: TF32 is far coarser than float32
    for chunk in (None, 256):
        blockwise = _errors(name, setting, chunk, inputs, want)
        for what, err, ref in zip(["loss", "grad a", "grad b", "grad scale"], blockwise, dense):
            assert err <= 2 * ref + 1e-6, f"{what}: blockwise {err:.2e} vs dense {ref:.2e} (chunk {chunk})"
