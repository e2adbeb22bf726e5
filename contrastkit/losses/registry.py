"""Names to loss classes, so that every recipe exposes ``--loss`` from one place."""

from __future__ import annotations

import inspect
from typing import Any, Literal, overload

from contrastkit.losses.base import Objective
from contrastkit.losses.cacr import CACRLoss
from contrastkit.losses.dcl import DCLLoss, DCLWLoss
from contrastkit.losses.infonce import EqCoLoss, InfoNCELoss
from contrastkit.losses.unigrad import UniGradLoss

LOSSES: dict[str, type[Objective]] = {
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


def objective_options(name: str, **settings: Any) -> dict[str, Any]:
    """Those of ``settings`` that the objective ``name`` takes (keyword arguments of its class), so that a
    recipe can pass all of its flags (temperature, alpha, sigma, lam, rho, gather_distributed, ...) and
    each objective keeps its own: CACR has no temperature, UniGrad no gather."""
    key = name.lower()
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    accepted = inspect.signature(LOSSES[key].__init__).parameters
    return {k: v for k, v in settings.items() if k in accepted}


@overload
def build_loss(name: Literal["infonce"], **options: Any) -> InfoNCELoss: ...
@overload
def build_loss(name: Literal["dcl"], **options: Any) -> DCLLoss: ...
@overload
def build_loss(name: Literal["dclw"], **options: Any) -> DCLWLoss: ...
@overload
def build_loss(name: Literal["eqco"], **options: Any) -> EqCoLoss: ...
@overload
def build_loss(name: Literal["cacr"], **options: Any) -> CACRLoss: ...
@overload
def build_loss(name: Literal["unigrad"], **options: Any) -> UniGradLoss: ...
@overload
def build_loss(name: str, **options: Any) -> Objective: ...


def build_loss(name: str, **options: Any) -> Objective:
    """The loss called ``name`` built with the keyword arguments of its class, e.g.
    ``build_loss("dcl", temperature=0.1, chunk_size=0)`` is ``DCLLoss(temperature=0.1, chunk_size=0)``.

    Typed per name (a literal name gives its class); any name gives an ``Objective``, whose
    ``query_key`` and ``cross_modal`` raise a ValueError for UniGrad."""
    key = name.lower()
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    try:
        return LOSSES[key](**options)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): {err}") from None
