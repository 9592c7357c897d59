"""Command-line flags declared on the config dataclasses: one source for a setting's default, choices and help.

A field becomes a flag by its metadata::

    @dataclass
    class PlannerConfig:
        planner: str = field(default="cpsat", metadata=flag("wavefront: ...; cpsat: ...", choices=PLANNERS))

    add_flags(parser.add_argument_group("spindle planner"), PlannerConfig, prefix="spindle-")
    # -> --spindle-planner {wavefront,cpsat}, default cpsat, dest args.spindle_planner
    config = config_from_args(PlannerConfig, args, prefix="spindle-")

The flag is ``--<prefix><field name in kebab-case>`` unless ``flag(name="--...")`` gives it (Megatron's names
where they differ from ours, e.g. ``--lr-warmup-iters`` for ``LRSchedule.warmup_iters``); the argparse dest is
the flag's name in snake case. The type comes from the annotation (``int``, ``float``, ``str``, ``X | None``;
a ``bool`` defaulting to False is a store-true switch, one defaulting to True a ``--flag / --no-flag`` pair), or from ``flag(type=...)`` for anything else.
Fields without ``flag`` metadata are not on the command line. ``check_choices`` validates a config against
the same choices, for configs built in code.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_KEY = "megatron_spindle.flag"


@dataclass(frozen=True)
class FlagSpec:
    help: str
    name: str | None = None  # the whole flag, "--lr-warmup-iters"; default: --<prefix><field-name>
    choices: tuple | None = None
    type: Callable[[str], Any] | None = None  # parses the flag's text; default: from the annotation
    metavar: str | None = None
    nargs: str | None = None  # "+": a list of values (the field holds a tuple)


def flag(help: str, *, name: str | None = None, choices: Sequence | None = None,
         type: Callable[[str], Any] | None = None, metavar: str | None = None,
         nargs: str | None = None) -> dict[str, FlagSpec]:
    """Field metadata making the field a command-line flag: ``field(default=..., metadata=flag(...))``."""
    if name is not None and not name.startswith("--"):
        raise ValueError(f"flag name must start with '--', got {name!r}")
    return {_KEY: FlagSpec(help, name, tuple(choices) if choices is not None else None, type, metavar, nargs)}


def flag_spec(f: dataclasses.Field) -> FlagSpec | None:
    return f.metadata.get(_KEY)


def flag_name(f: dataclasses.Field, prefix: str = "") -> str:
    spec = flag_spec(f)
    return spec.name if spec is not None and spec.name else f"--{prefix}{f.name.replace('_', '-')}"


def finite_float(text: str) -> float:
    """argparse type of every float flag: a number, not nan or inf ("invalid finite float value: 'nan'")."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(text)
    return v


finite_float.__name__ = "finite float"


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _scalar_type(annotation: Any, where: str) -> type:
    """int / float / str from ``X`` or ``X | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation = args[0]
    if annotation in (int, float, str, bool):
        return annotation
    raise TypeError(f"{where}: no flag type for annotation {annotation!r}; give flag(type=...)")


def _flagged(cls: type) -> list[tuple[dataclasses.Field, FlagSpec]]:
    return [(f, flag_spec(f)) for f in dataclasses.fields(cls) if flag_spec(f) is not None]


def add_flags(group, cls: type, prefix: str = ""):
    """Add a flag for every ``flag``-annotated field of dataclass ``cls`` to ``group`` (a parser or an argument
    group); returns ``group``."""
    hints = typing.get_type_hints(cls)
    for f, spec in _flagged(cls):
        option, default = flag_name(f, prefix), _default(f)
        kwargs: dict[str, Any] = {"dest": _dest(option), "help": spec.help}
        typ = spec.type or _scalar_type(hints[f.name], f"{cls.__name__}.{f.name}")
        typ = finite_float if typ is float else typ
        if typ is bool:
            if default not in (False, True):
                raise TypeError(f"{cls.__name__}.{f.name}: a bool flag defaults to False or True")
            # off by default: a switch; on by default: --flag / --no-flag (like --overlap-grad-reduce)
            kwargs.update(action="store_true" if default is False else argparse.BooleanOptionalAction,
                          default=default)
        else:
            kwargs.update(type=typ)
            if default is dataclasses.MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.metavar is not None:
                kwargs["metavar"] = spec.metavar
            if spec.nargs is not None:
                kwargs["nargs"] = spec.nargs
        group.add_argument(option, **kwargs)
    return group


def config_from_args(cls: type, args: argparse.Namespace, prefix: str = "", **overrides):
    """An instance of ``cls`` from the flags ``add_flags(…, cls, prefix)`` added; ``overrides`` set fields the
    command line does not (or replace what it says)."""
    values = {f.name: getattr(args, _dest(flag_name(f, prefix))) for f, _ in _flagged(cls)}
    return cls(**{**values, **overrides})


def check_choices(config) -> None:
    """ValueError naming the field when a value is not among its flag's choices."""
    for f, spec in _flagged(type(config)):
        value = getattr(config, f.name)
        if value is None and f.default is None:  # an optional flag left out
            continue
        if spec.nargs is not None and spec.choices is not None and not isinstance(value, str):
            bad = [v for v in value if v not in spec.choices]
            if bad:
                raise ValueError(f"unknown {f.name} '{bad[0]}' (expected one of {', '.join(map(str, spec.choices))})")
            continue
        if spec.choices is not None and value not in spec.choices:
            raise ValueError(f"unknown {f.name} '{value}' (expected one of {', '.join(map(str, spec.choices))})")
