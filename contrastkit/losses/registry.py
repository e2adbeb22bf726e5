"""Names to loss classes, so that every recipe exposes ``--loss`` from one place.

Another library's name or keyword argument is never taken silently for something else: a name is accepted
only where it builds the very loss it names (contrastkit's own class names, ``build_loss("DCLLoss")``), and
the errors for the others name what to write instead (FOREIGN_NAMES, FOREIGN_KEYWORDS)."""

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

# Other libraries' loss names (compared lower-case, without "_", "-" or spaces): what to write here instead.
# None of them is an alias: each would give another value or another call (docs/ecosystems/lightly.md).
_NTXENT = ("lightly's NTXentLoss is InfoNCE at temperature 0.5 by default: build_loss('infonce', temperature=0.5) is "
           "the same value, build_loss('dcl') the swap (temperature 0.1, as lightly's DCLLoss)")
_SIGLIP = "open_clip's SigLipLoss has no form in the loss core: the CLIP recipe's --loss siglip runs open_clip's own"
FOREIGN_NAMES: dict[str, str] = {
    "ntxent": _NTXENT,
    "ntxentloss": _NTXENT,
    "multiplenegativesrankingloss": "sentence-transformers' MultipleNegativesRankingLoss is "
                                    "contrastkit.adapters.sentence_transformers.MultipleNegativesLoss(model, "
                                    "loss='infonce'), or loss='dcl'; on embeddings, build_loss('infonce', "
                                    "temperature=0.05).query_key(anchor, positive) (its scale 20 is 1 / temperature)",
    "cachedmultiplenegativesrankingloss": "sentence-transformers' CachedMultipleNegativesRankingLoss is "
                                          "contrastkit.adapters.sentence_transformers.CachedMultipleNegativesLoss"
                                          "(model, loss='infonce'), or loss='dcl'",
    "cliploss": "open_clip's ClipLoss is build_loss('infonce').cross_modal(image, text, logit_scale=...), or "
                "'dcl'; in open_clip_train, the open_clip adapter (python -m contrastkit.adapters.open_clip --loss dcl)",
    "siglip": _SIGLIP,
    "sigliploss": _SIGLIP,
}

# Other libraries' keyword arguments: what to write here instead.
_OPEN_CLIP_MODES = ("open_clip's ClipLoss(local_loss=True, gather_with_grad=True) is gather_distributed=True; its other "
                    "modes: the open_clip adapter's ContrastkitClipLoss(name, local_loss=..., gather_with_grad=...)")
FOREIGN_KEYWORDS: dict[str, str] = {
    "memory_bank_size": "lightly's memory bank is a queue you keep, [Q, D], given to loss_fn.query_key(query, key, "
                        "queue) (NTXentLoss with a bank is build_loss('infonce', temperature=0.5).query_key); the "
                        "vision recipe's --method moco keeps one",
    "weight_fn": "lightly's DCLLoss(weight_fn=...): the DCL paper's weight (lightly's DCLWLoss) is "
                 "build_loss('dclw', sigma=0.5); no other weighting function is taken",
    "local_loss": _OPEN_CLIP_MODES,
    "gather_with_grad": _OPEN_CLIP_MODES,
    "cache_labels": "open_clip's label cache: drop it (the layout is made once per shape and device)",
    "rank": "the rank is read from torch.distributed at each call: drop it (gather_distributed=True gathers)",
    "world_size": "the world size is read from torch.distributed at each call: drop it (gather_distributed=True "
                  "gathers)",
    "use_horovod": "contrastkit gathers with torch.distributed; horovod is not supported",
    "scale": "sentence-transformers' scale is 1 / temperature: temperature=0.05 for its scale 20",
    "similarity_fct": "cosine similarity is the default (normalize=True); a dot product is normalize=False",
    "tau": "the temperature is temperature=",
}


def _key(name: str) -> str:
    """The registry's key for ``name`` (one of LOSSES in any case, or a contrastkit class name such as
    "DCLLoss"), or a ValueError that says what to use: for another library's name, the contrastkit call."""
    if not isinstance(name, str):
        raise TypeError(f"build_loss: the loss name must be a string, one of {', '.join(LOSSES)}; "
                        f"got {type(name).__name__}")
    key = name.lower()
    if key in LOSSES:
        return key
    for known, cls in LOSSES.items():
        if key == cls.__name__.lower():  # contrastkit's own class: build_loss("DCLLoss") is DCLLoss()
            return known
    hint = FOREIGN_NAMES.get(key.replace("_", "").replace("-", "").replace(" ", ""))
    raise ValueError(f"unknown loss {name!r}{f' ({hint})' if hint else ''}; choose one of {', '.join(LOSSES)}")


def available_losses() -> list[str]:
    """The names build_loss accepts."""
    return list(LOSSES)


def register_loss(cls: type[Objective]) -> type[Objective]:
    """Add an objective of one's own to the names build_loss (and so every recipe's ``--loss``) accepts, under
    its class's ``name``; usable as a class decorator. A name taken by another class, or another library's
    (FOREIGN_NAMES), is a ValueError."""
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise TypeError(f"register_loss: expected a subclass of contrastkit.losses.Objective, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name or name != name.lower() or name in ("objective", "contrastive"):
        raise ValueError(f"register_loss: {cls.__name__} needs a class attribute name, a lower-case string of its "
                         f"own (got {name!r})")
    if LOSSES.get(name, cls) is not cls:
        raise ValueError(f"register_loss: the name {name!r} is taken by {LOSSES[name].__name__}")
    if name.replace("_", "").replace("-", "") in FOREIGN_NAMES:
        raise ValueError(f"register_loss: {name!r} is another library's loss ({FOREIGN_NAMES[name]}); choose another")
    LOSSES[name] = cls
    return cls


def _keywords(cls: type[Objective]) -> list[str] | None:
    """The keyword arguments ``cls`` takes, in its signature's order (None: it takes any)."""
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _unknown_keywords(key: str, options: dict[str, Any]) -> str | None:
    """The error for the keywords of ``options`` that the objective ``key`` does not take, each with what to
    use where it is known: another library's (FOREIGN_KEYWORDS) or another objective's; None if all are taken."""
    cls = LOSSES[key]
    accepted = _keywords(cls)
    if accepted is None:
        return None
    unknown = [k for k in options if k not in accepted]
    if not unknown:
        return None
    notes = []
    for k in unknown:
        owners = [name for name, other in LOSSES.items() if k in (_keywords(other) or [])]
        if k in FOREIGN_KEYWORDS:
            notes.append(f"{k}: {FOREIGN_KEYWORDS[k]}")
        elif owners:
            notes.append(f"{k}: an option of {', '.join(owners)}, not of {key}")
    listed = ", ".join(repr(k) for k in unknown)
    plural = "s" if len(unknown) > 1 else ""
    why = f" ({'; '.join(notes)})" if notes else ""
    return (f"{cls.__name__} got unexpected keyword argument{plural} {listed}{why}; "
            f"it takes {', '.join(accepted)}")


def objective_options(name: str, **settings: Any) -> dict[str, Any]:
    """Those of ``settings`` that the objective ``name`` takes (keyword arguments of its class), so that a
    recipe can pass all of its flags (temperature, alpha, sigma, lam, rho, gather_distributed, ...) and
    each objective keeps its own: CACR has no temperature, UniGrad no gather."""
    accepted = inspect.signature(LOSSES[_key(name)].__init__).parameters
    return {k: v for k, v in settings.items() if k in accepted}


@overload
def build_loss(name: Literal["infonce"], *args: Any, **options: Any) -> InfoNCELoss: ...
@overload
def build_loss(name: Literal["dcl"], *args: Any, **options: Any) -> DCLLoss: ...
@overload
def build_loss(name: Literal["dclw"], *args: Any, **options: Any) -> DCLWLoss: ...
@overload
def build_loss(name: Literal["eqco"], *args: Any, **options: Any) -> EqCoLoss: ...
@overload
def build_loss(name: Literal["cacr"], *args: Any, **options: Any) -> CACRLoss: ...
@overload
def build_loss(name: Literal["unigrad"], *args: Any, **options: Any) -> UniGradLoss: ...
@overload
def build_loss(name: str, *args: Any, **options: Any) -> Objective: ...


def build_loss(name: str, *args: Any, **options: Any) -> Objective:
    """The loss called ``name`` built with the arguments of its class, positional ones included, e.g.
    ``build_loss("dcl", 0.2)`` is ``DCLLoss(0.2)`` and ``build_loss("dcl", temperature=0.1, chunk_size=0)`` is
    ``DCLLoss(temperature=0.1, chunk_size=0)``. ``name`` is one of available_losses() in any case, or a
    contrastkit class name ("DCLLoss"). Another library's name (lightly's "NTXentLoss", sentence-transformers'
    "MultipleNegativesRankingLoss", ...) is a ValueError that names the contrastkit call to use; keywords the
    class does not take are one TypeError that names them all, and for another library's (lightly's
    ``memory_bank_size``, open_clip's ``local_loss``, ...) what to use instead.

    Typed per name (a literal name gives its class); any name gives an ``Objective``, whose
    ``query_key`` and ``cross_modal`` raise a ValueError for UniGrad."""
    key = _key(name)
    unknown = _unknown_keywords(key, options)
    if unknown:
        raise TypeError(f"build_loss({name!r}): {unknown}")
    try:
        return LOSSES[key](*args, **options)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): {err}") from None
