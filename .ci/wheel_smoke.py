"""Smoke test of the installed wheel, run from outside the source tree by .ci/wheel_smoke.sh.

Checks that the wheel carries what the package needs at run time (py.typed, LICENSE, the CLIP
configs) and that every loss and the main job's model work from it.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import torch

import contrastkit
from contrastkit.losses import ContrastiveLoss, available_losses, build_loss

source = Path(sys.argv[1]).resolve()
installed = Path(contrastkit.__file__).resolve().parent
assert installed.is_relative_to(Path(sys.prefix).resolve()) and not installed.is_relative_to(source), (
    f"contrastkit was imported from {installed}, not from the wheel installed in {sys.prefix}")
assert (installed / "py.typed").is_file(), "py.typed missing from the wheel"
files = {Path(str(f)).name for f in metadata.files("contrastkit")}
assert "LICENSE" in files, "LICENSE missing from the wheel's metadata"

g = torch.Generator().manual_seed(0)
z1, z2, z3 = (torch.randn(8, 16, generator=g, requires_grad=True) for _ in range(3))
for name in available_losses():
    loss_fn = build_loss(name)
    losses = [loss_fn(z1, z2), build_loss(name, reduction="none")(z1, z2).mean()]
    if isinstance(loss_fn, ContrastiveLoss):
        losses += [loss_fn.query_key(z1, z2, z3), loss_fn.cross_modal(z1, z2)]
    for loss in losses:
        grads = torch.autograd.grad(loss, (z1, z2))
        assert loss.ndim == 0 and torch.isfinite(loss) and all(torch.isfinite(x).all() for x in grads), name
    torch.testing.assert_close(losses[0], losses[1])  # mean of the per-anchor losses is the mean loss
    print(f"{name}: {losses[0].detach().item():.4f}")

from contrastkit.adapters.open_clip import create_clip  # noqa: E402  (needs the clip extra)

model, preprocess, tokenizer = create_clip("contrastkit-tiny")
out = model(torch.randn(2, 3, 32, 32), tokenizer(["a red circle", "a blue square"]))
assert out["image_features"].shape == out["text_features"].shape == (2, 64)
print("create_clip('contrastkit-tiny'): ok, from", installed)
