"""One patch mechanism and one handle type for every adapter.

A *target* (a class, a model instance, or a module such as ``open_clip``) holds at most one contrastkit
patch, recorded on the target itself; patching it again first restores it (the new objective replaces
the old). ``Patch`` is the handle that every adapter's ``patch`` returns: ``undo()`` (or leaving its
``with`` block) restores its targets to their original state, whichever patch is on them by then, and
``objective`` is what it installed.

Two ways to change a target:

- ``replace_attribute`` / ``replace_attributes``: attributes swapped, and swapped back (open_clip's
  ``create_loss`` and ``create_task``, fairseq2's ``compute_contrastive_loss``).
- ``wrap_call``: code run around the model's call, outside its ``forward``. On a class it overrides the
  class's ``__call__``; on an instance it registers forward pre- and post-hooks. Neither touches
  ``forward``, so wrappers that others put on an instance's ``forward`` (accelerate's autocast and
  float32 conversion under mixed precision) stay in place whether they came before or after the patch,
  and are left alone by ``undo``. DDP and accelerate call the inner module, so the hooks run there too.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading

import torch
from torch import nn

RECORD = "_contrastkit_patch"


class _Record:
    """What a patch changed on one target: its objective and how to restore the target."""

    def __init__(self, objective, restore):
        self.objective, self.restore = objective, restore


class Patch:
    """What an adapter's ``patch`` did: ``undo()`` (or leaving the ``with`` block) restores its targets;
    ``objective`` is the objective it installed, ``targets`` what it changed."""

    def __init__(self, objective):
        self.objective = objective
        self.targets: list = []

    def add(self, target, restore) -> None:
        """Record that ``target`` was changed (``restore()`` undoes it); replaces an earlier patch's record."""
        _set(target, RECORD, _Record(self.objective, restore))
        if not any(t is target for t in self.targets):
            self.targets.append(target)

    def undo(self) -> None:
        for target in reversed(self.targets):
            remove(target)
        self.targets = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self) -> str:
        return f"Patch({self.objective!r}, {len(self.targets)} target(s))"


def _own(target) -> dict:
    """The target's own attributes (not inherited ones)."""
    return target.__dict__ if isinstance(target, type) else vars(target)


def _set(target, name, value) -> None:
    # object.__setattr__ keeps an nn.Module objective out of a model's submodules (and its state_dict)
    if isinstance(target, type):
        setattr(target, name, value)
    else:
        object.__setattr__(target, name, value)


def remove(target) -> None:
    """Restore ``target`` if a contrastkit patch is on it."""
    record = _own(target).get(RECORD)
    if record is not None:
        record.restore()
        if isinstance(target, type):
            delattr(target, RECORD)
        else:
            object.__delattr__(target, RECORD)


def replace_attribute(handle: Patch, owner, name: str, value) -> None:
    """Set ``owner.name = value`` (owner a class, an instance or a module), restored by ``handle.undo()``."""
    remove(owner)
    missing = object()
    before = _own(owner).get(name, missing)

    def restore():
        if before is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, before)

    setattr(owner, name, value)
    handle.add(owner, restore)


def replace_attributes(handle: Patch, owner, values: dict) -> None:
    """``replace_attribute`` for several names of one owner at once (one record: one patch per target), all
    restored together by ``handle.undo()``."""
    remove(owner)
    missing = object()
    before = {name: _own(owner).get(name, missing) for name in values}

    def restore():
        for name, value in before.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    for name, value in values.items():
        setattr(owner, name, value)
    handle.add(owner, restore)


def wrap_call(handle: Patch, target, pre, post) -> None:
    """Run ``pre(module, args, kwargs) -> (args, kwargs, state)`` before and ``post(module, state, output)
    -> output`` after every call of ``target`` (a module class or instance); state None means this call is
    left alone (post is not run). Restored by ``handle.undo()``."""
    remove(target)
    if isinstance(target, type):
        own = target.__dict__.get("__call__")
        inherited = super(target, target).__call__ if own is None else own

        def __call__(self, *args, **kwargs):
            if RECORD in vars(self):  # the instance has a patch of its own: its hooks do the work
                return inherited(self, *args, **kwargs)
            args, kwargs, state = pre(self, args, kwargs)
            output = inherited(self, *args, **kwargs)
            return output if state is None else post(self, state, output)

        target.__call__ = __call__

        def restore():
            if own is None:
                del target.__call__
            else:
                target.__call__ = own
    else:
        local = threading.local()  # DataParallel runs replicas (sharing these hooks) in threads

        def pre_hook(module, args, kwargs):
            args, kwargs, local.state = pre(module, args, kwargs)
            return args, kwargs

        def post_hook(module, args, kwargs, output):
            state, local.state = getattr(local, "state", None), None
            return output if state is None else post(module, state, output)

        hooks = [target.register_forward_pre_hook(pre_hook, with_kwargs=True),
                 target.register_forward_hook(post_hook, with_kwargs=True)]

        def restore():
            for hook in hooks:
                hook.remove()

    handle.add(target, restore)


def call_arguments(model, args: tuple, kwargs: dict) -> dict:
    """Every argument of a call of a Hugging Face ``model`` by name (its ``**kwargs`` flattened).
    ``return_dict`` is taken apart from the signature: transformers 4.x's ``can_return_tuple`` accepts it
    without naming it, transformers 5 takes it through ``**kwargs``."""
    named = dict(kwargs)
    missing = object()
    return_dict = named.pop("return_dict", missing)
    signature = _signature(type(model))
    arguments = dict(signature.bind(model, *args, **named).arguments)
    arguments.pop("self", None)
    for name, p in signature.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    if return_dict is not missing:
        arguments["return_dict"] = return_dict
    return arguments


@functools.cache
def _signature(cls) -> inspect.Signature:
    return inspect.signature(cls.forward)


def unwrap(model):
    """The model inside DDP, DataParallel, FSDP and ``torch.compile`` wrappers (accelerate's included)."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except ImportError:  # pragma: no cover - torch built without distributed
        pass
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def active_objective(target):
    """The objective a contrastkit patch makes ``target`` use (its own patch, else its class's), or None.
    Sees through DDP/accelerate/compile wrappers."""
    target = unwrap(target)
    record = _own(target).get(RECORD) if not isinstance(target, type) else None
    if record is None:
        cls = target if isinstance(target, type) else type(target)
        record = next((k.__dict__[RECORD] for k in cls.__mro__ if RECORD in k.__dict__), None)
    return None if record is None else record.objective


# ----------------------------------------------------------------------------- one-import modules


def env_options(*, gather: bool = False) -> tuple[str, dict]:
    """The objective chosen by the environment for a one-import module: (loss, options).

    CONTRASTKIT_LOSS (default dcl), CONTRASTKIT_TEMPERATURE (a positive number; default the model's own)
    and, with ``gather``, CONTRASTKIT_GATHER (1/true/yes or 0/false/no). Checked here, at import, with
    errors that name the variable.
    """
    loss = os.environ.get("CONTRASTKIT_LOSS", "").strip() or "dcl"
    options: dict = {}
    text = os.environ.get("CONTRASTKIT_TEMPERATURE", "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"CONTRASTKIT_TEMPERATURE={text!r} is not a number (a positive temperature, "
                             "e.g. 0.1, or unset for the model's own)") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"CONTRASTKIT_TEMPERATURE={text!r}: the temperature must be a positive finite number")
        options["temperature"] = value
    if gather:
        text = os.environ.get("CONTRASTKIT_GATHER", "").strip().lower()
        if text in ("", "0", "false", "no"):
            options["gather_with_grad"] = False
        elif text in ("1", "true", "yes"):
            options["gather_with_grad"] = True
        else:
            raise ValueError(f"CONTRASTKIT_GATHER={text!r}: use 1/true/yes (negatives from every process) or "
                             "0/false/no")
    return loss, options


def patch_from_env(patch, *, gather: bool = False) -> Patch:
    """``patch(None, loss=..., **options)`` with the environment's choice (see ``env_options``); an invalid
    CONTRASTKIT_LOSS is reported with the variable's name."""
    loss, options = env_options(gather=gather)
    try:
        return patch(None, loss=loss, **options)
    except ValueError as err:
        raise ValueError(f"CONTRASTKIT_LOSS={loss!r}: {err}") from None

