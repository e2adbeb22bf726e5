"""One command line for every recipe and eval script.

A script describes its options as a dataclass whose fields carry their help (``arg(default, "help")``,
the Hugging Face examples' style) and calls ``parse``. transformers' ``HfArgumentParser`` builds the
parser: ``--batch-size`` and ``--batch_size`` spellings, ``--x`` / ``--no-x`` for booleans, choices, and
every default in ``--help``. On top of it:

- ``--config run.yaml``: values for any option (keys spelt as the options, ``-`` or ``_``); the command
  line overrides them.
- ``dict`` fields (loss options) are repeated ``--loss-option KEY=VALUE`` flags with typed values:
  ``chunk_size=512`` is an int, ``sigma=0.5`` a float, ``flag=true`` a bool, anything else a string.
- Every user mistake (an unknown flag, a value outside the choices, a dataclass's ``check()`` failing:
  a missing path, a batch of 0, a negative learning rate) ends in one ``error: ...`` line on stderr and
  exit status 2, before any work and without a traceback.
- A failure during the work that the user can act on (a run that diverged, a checkpoint that cannot be
  read or written, a file that is not what it claims) is a ``RunError``; ``one_line_errors`` turns it
  into one ``error: ...`` line too (exit status 1, or 2 for bad input).
- ``bool | str`` fields are flags that take an optional word of their ``choices``: ``--resume``,
  ``--resume auto``, ``--no-resume``.
- ``--help`` shows one spelling per option (``--batch-size``, ``--no-progress``; the ``_`` spellings
  are accepted too) and one default.
- A field's ``aliases`` (``arg(aliases=[...])``: an earlier name, a short one) are more names of the one
  option, on the command line and as ``--config`` keys; two names of one option with different values are an
  error. ``renamed`` gives a saved config's (a checkpoint's) earlier keys their field's name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Callable, get_type_hints

from transformers import HfArgumentParser


def arg(default: Any = dataclasses.MISSING, help: str = "", *, choices=None, factory=None, aliases=None,
        metavar=None) -> Any:
    """A dataclass field that is also a documented command-line option."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if aliases:
        metadata["aliases"] = aliases
    if metavar:
        metadata["metavar"] = metavar
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def typed_value(text: str) -> int | float | bool | str:
    """``"512"`` -> 512, ``"0.5"`` -> 0.5, ``"1e-3"`` -> 0.001, ``"true"`` -> True, anything else: the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return text


def key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), typed_value(value.strip())


def flag_or_word(words) -> Any:
    """The type of a ``bool | str`` option: a word of ``words``, or a boolean (``true``, ``no``, ...)."""

    def convert(text: str) -> bool | str:
        if text in words:
            return text
        if text.lower() in ("true", "yes", "1", "false", "no", "0"):
            return text.lower() in ("true", "yes", "1")
        raise argparse.ArgumentTypeError(f"takes no value or one of {', '.join(words)}, got {text!r}")

    return convert


def positive(name: str, value, *, zero: bool = False) -> None:
    """Raise ValueError unless ``value`` > 0 (or >= 0 with ``zero``); ``name`` is the option as typed."""
    if value is not None and (value < 0 if zero else value <= 0):
        raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if zero else '> 0'}, got {value}")


def existing(name: str, path, what: str = "path") -> None:
    """Raise FileNotFoundError unless ``path`` (when given) exists."""
    if path is not None and not Path(path).exists():
        raise FileNotFoundError(f"--{name.replace('_', '-')}: {what} {str(path)!r} does not exist")


class RunError(Exception):
    """A failure a user can act on, with a message that says what happened and what to do; ``status``:
    the exit status ``one_line_errors`` gives it (1: the run failed; 2: bad input)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def one_line_errors(*kinds: type[BaseException], status: int = 2):
    """Inside a script's main: a RunError, or an exception of ``kinds`` (bad input found while working,
    e.g. ValueError from a checkpoint loader; exit ``status``), ends as one ``error:`` line on stderr."""
    try:
        yield
    except RunError as err:
        sys.stderr.write(f"error: {' '.join(str(err).split())}\n")
        raise SystemExit(err.status) from None
    except kinds as err:
        sys.stderr.write(f"error: {' '.join(str(err).split())}\n")
        raise SystemExit(status) from None


@contextlib.contextmanager
def held_back(logger: logging.Logger, match: Callable[[str], bool]):
    """Inside the block, the records of ``logger`` whose message ``match`` accepts are held back, not shown: a
    library's note on what the script does on purpose. Yields the list of them, for the caller to show
    (``logger.handle(record)``) where they turn out to say more; every other record passes as usual."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if match(record.getMessage()):
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield held
    finally:
        logger.removeFilter(hold)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):
        if isinstance(action, argparse._StoreFalseAction):  # --no-x: its "default" is the value it stores
            return action.help
        if action.default is None and "(default" in (action.help or ""):  # the help says it in words
            return action.help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):  # one spelling: --batch-size, not also --batch_size
        return super()._format_action_invocation(_dashed(action))

    def _format_usage(self, usage, actions, groups, prefix):
        return super()._format_usage(usage, [_dashed(a) for a in actions], groups, prefix)


def _dashed(action: argparse.Action) -> argparse.Action:
    """``action`` shown without the ``--x_y`` spellings that have a ``--x-y`` twin (both are accepted)."""
    names = action.option_strings
    shown = [n for n in names if "_" not in n or n.replace("_", "-") not in names]
    if shown == names:
        return action
    return argparse.Action(shown, action.dest, nargs=action.nargs, const=action.const, default=action.default,
                           type=action.type, choices=action.choices, required=action.required, help=action.help,
                           metavar=action.metavar)


GIVEN = "_given_as"  # the namespace attribute where _Store notes each option's spelling and value


class _Store(argparse._StoreAction):
    """argparse's store action, which also refuses one option given under two of its names (an alias and the
    field's name) with different values: argparse would keep the last one without a word. The same name
    given twice keeps the last value, as argparse does (``--x-y`` and ``--x_y`` are one name)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).setdefault(GIVEN, {})
        name = (option_string or "").replace("_", "-")
        earlier = given.get(self.dest)
        if earlier is not None and earlier[0] != name and earlier[1] != values:
            parser.error(f"argument {name}: {earlier[0]} {earlier[1]} was given too, and they are one option "
                         f"(--{self.dest.replace('_', '-')}): give it once")
        given[self.dest] = (name, values)
        setattr(namespace, self.dest, values)


def aliases(*types) -> dict[str, str]:
    """{alias as a field name (``warmup_steps``): the field's name} of the dataclasses' fields."""
    return {name.lstrip("-").replace("-", "_"): f.name for t in types for f in dataclasses.fields(t)
            for name in f.metadata.get("aliases", []) if name.startswith("--")}


def renamed(values: dict, *types, where: str = "") -> dict:
    """``values`` (a config file's, a checkpoint's saved config) with each alias key under its field's name;
    a ValueError where both are given with different values (``where`` names the source)."""
    names = aliases(*types)
    out = {k: v for k, v in values.items() if k not in names}
    for key, value in values.items():
        if key in names:
            field = names[key]
            if field in out and out[field] != value:
                raise ValueError(f"{where}{key} {value} and {field} {out[field]} are one option "
                                 f"(--{field.replace('_', '-')}): give it once")
            out[field] = value
    return out


class Parser(HfArgumentParser):
    """HfArgumentParser with dict and tuple fields, aliases, ``--config`` and one-line errors."""

    def __init__(self, types, description: str | None = None, config_flag: bool = True):
        super().__init__(types, description=description, formatter_class=_Formatter)
        if config_flag:
            self.add_argument("--config", default=None, metavar="YAML",
                              help="YAML file of option values (keys as the long options); "
                                   "the command line overrides it")

    def _add_dataclass_arguments(self, dtype):
        self.register("action", None, _Store)  # every plain option: one value, whichever of its names gave it
        self.register("action", "store", _Store)
        super()._add_dataclass_arguments(dtype)

    @staticmethod
    def _parse_dataclass_field(parser, field):
        origin = getattr(field.type, "__origin__", field.type)
        help_text = field.metadata.get("help", "")
        names = [f"--{field.name}", f"--{field.name.replace('_', '-')}"][: 1 + ("_" in field.name)]
        names += field.metadata.get("aliases", [])
        if origin is dict:
            parser.add_argument(*names, dest=field.name, action="append", type=key_value, default=None,
                                metavar="KEY=VALUE", help=help_text + " (repeat the flag for several)")
        elif set(getattr(field.type, "__args__", ())) == {bool, str}:  # --resume, --resume auto, --no-resume
            words = field.metadata.get("choices", [])
            parser.add_argument(*names, dest=field.name, nargs="?", const=True, default=field.default,
                                type=flag_or_word(words), metavar="|".join(words) or None, help=help_text)
            parser.add_argument(*[f"--no{n[1:]}" for n in names[:2]], dest=field.name, action="store_false",
                                help=f"turn --{field.name.replace('_', '-')} off")
        elif origin is tuple:
            kind = field.type.__args__[0]
            parser.add_argument(*names, dest=field.name, nargs=len(field.type.__args__), type=kind,
                                default=field.default, help=help_text)
        else:
            HfArgumentParser._parse_dataclass_field(parser, field)
            if field.type is bool:
                off = f"turn --{field.name.replace('_', '-')} off"
                if field.default is False:  # HF adds --no-x only where the default is True
                    parser.add_argument(*[f"--no{n[1:]}" for n in names[:2]], dest=field.name, action="store_false",
                                        help=off)
                else:
                    parser._actions[-1].help = off

    def error(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def _load_config(parser: Parser, path: str, types) -> dict:
    import yaml

    if not Path(path).is_file():
        parser.error(f"--config: {path!r} does not exist")
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        parser.error(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    known = {f.name for t in types for f in dataclasses.fields(t)}
    try:
        values = renamed({str(k).replace("-", "_"): v for k, v in values.items()}, *types, where=f"--config {path}: ")
    except ValueError as err:
        parser.error(str(err))
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"--config {path}: unknown option(s) {', '.join(unknown)}")
    return values


def parse(*types, description: str | None = None, argv: list[str] | None = None, config_flag: bool = True):
    """Parse ``argv`` (default sys.argv) into one instance of each dataclass in ``types``, checked.

    A dataclass may define ``check()``, raising ValueError / FileNotFoundError for a bad value; the
    message becomes the ``error:`` line. Returns the instance (one type) or a tuple of them.
    """
    parser = Parser(types, description, config_flag)
    argv = sys.argv[1:] if argv is None else list(argv)
    from_file = {}
    if config_flag:
        early = argparse.ArgumentParser(add_help=False)
        early.add_argument("--config")
        path = early.parse_known_args(argv)[0].config
        if path is not None:
            from_file = _load_config(parser, path, types)
    dict_fields = {name for t in types for name, kind in get_type_hints(t).items()
                   if getattr(kind, "__origin__", kind) is dict}
    parser.set_defaults(**{k: v for k, v in from_file.items() if k not in dict_fields})
    namespace = parser.parse_args(argv)
    for action in parser._actions:  # values from the file skip argparse's own choice check
        value = getattr(namespace, action.dest, None)
        if action.choices is not None and value is not None:
            for item in value if isinstance(value, list) else [value]:
                if item not in action.choices:
                    parser.error(f"argument {action.option_strings[-1]}: invalid choice {item!r} "
                                 f"(choose from {', '.join(map(str, action.choices))})")
    out = []
    for dtype in types:
        values = {}
        for f in dataclasses.fields(dtype):
            if not f.init:
                continue
            value = getattr(namespace, f.name)
            if f.name in dict_fields:
                merged = f.default_factory() if f.default_factory is not dataclasses.MISSING else {}
                value = {**merged, **(from_file.get(f.name) or {}), **dict(value or [])}
            values[f.name] = value
        try:
            obj = dtype(**values)
            if hasattr(obj, "check"):
                obj.check()
        except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as err:
            parser.error(str(err))
        out.append(obj)
    return out[0] if len(out) == 1 else tuple(out)


def default_device() -> str:
    """cuda when a GPU is visible, else cpu (the evals' --device default)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> None:
    """Raise ValueError for a device string torch does not know or a GPU that is not there."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible")
