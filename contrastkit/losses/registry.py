"""Names to loss classes, so that every recipe exposes ``--loss`` from one place."""

from __future__ import annotations

from torch import nn

from contrastkit.losses.cacr import CACRLoss
from contrastkit.losses.dcl import DCLLoss, DCLWLoss
from contrastkit.losses.infonce import EqCoLoss, InfoNCELoss
from contrastkit.losses.unigrad import UniGradLoss

LOSSES: dict[str, type[nn.Module]] = {
    "infonce": InfoNCELoss,
    "dcl": DCLLoss,
    "dclw": DCLWLoss,
    "eqco": EqCoLoss,
    "cacr": CACRLoss,
    "unigrad": UniGradLoss,
}


def available_losses() -> list[str]:
    """The names build_loss accepts."""
    return list(LOSSES)


def build_loss(name: str, **options) -> nn.Module:
    """The loss called ``name`` with its options, e.g. ``build_loss("dcl", temperature=0.1)``."""
    key = name.lower()
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    try:
        return LOSSES[key](**options)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): {err}") from None
