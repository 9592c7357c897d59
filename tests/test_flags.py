"""Flags declared on config dataclasses (megatron_spindle/flags.py): names, types, defaults, choices, round trip."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from megatron_spindle.arguments import add_spindle_args, planner_config_from_args
from megatron_spindle.flags import add_flags, check_choices, config_from_args, flag
from megatron_spindle.planner.pipeline import DISTRIBUTED_OPTIMIZER, PlannerConfig


@dataclass
class Toy:
    mode: str = field(default="a", metadata=flag("The mode.", choices=("a", "b")))
    limit: int | None = field(default=None, metadata=flag("A limit."))
    warmup_iters: int = field(default=0, metadata=flag("Warmup.", name="--toy-warmup"))
    fast: bool = field(default=False, metadata=flag("Go fast."))
    names: tuple[str, ...] = field(default=(), metadata=flag("Names.", type=lambda s: tuple(s.split(","))))
    internal: float = 1.5  # no flag


def _parser(cls, prefix=""):
    p = argparse.ArgumentParser()
    add_flags(p.add_argument_group("toy"), cls, prefix=prefix)
    return p


def test_fields_become_flags_with_their_defaults():
    p = _parser(Toy, prefix="x-")
    args = p.parse_args([])
    assert (args.x_mode, args.x_limit, args.toy_warmup, args.x_fast, args.x_names) == ("a", None, 0, False, ())
    assert not hasattr(args, "x_internal")
    args = p.parse_args(["--x-mode", "b", "--x-limit", "3", "--toy-warmup", "7", "--x-fast", "--x-names", "p,q"])
    assert config_from_args(Toy, args, prefix="x-", internal=2.0) == Toy("b", 3, 7, True, ("p", "q"), 2.0)
    with pytest.raises(SystemExit):
        p.parse_args(["--x-mode", "c"])  # not among the field's choices


def test_a_bool_on_by_default_is_a_flag_pair():
    @dataclass
    class OnByDefault:
        on: bool = field(default=True, metadata=flag("On."))

    p = _parser(OnByDefault)
    assert config_from_args(OnByDefault, p.parse_args([])) == OnByDefault(True)
    assert config_from_args(OnByDefault, p.parse_args(["--on"])) == OnByDefault(True)
    assert config_from_args(OnByDefault, p.parse_args(["--no-on"])) == OnByDefault(False)


def test_unflaggable_fields_are_refused():
    @dataclass
    class Maybe:
        on: bool | None = field(default=None, metadata=flag("On."))

    @dataclass
    class Listy:
        xs: list[int] = field(default_factory=list, metadata=flag("Xs."))

    with pytest.raises(TypeError, match="defaults to False or True"):
        _parser(Maybe)
    with pytest.raises(TypeError, match="give flag"):
        _parser(Listy)


def test_check_choices_names_the_field():
    with pytest.raises(ValueError, match="unknown mode 'z'"):
        check_choices(Toy(mode="z"))
    with pytest.raises(ValueError, match="unknown distributed_optimizer 'maybe'"):
        PlannerConfig(distributed_optimizer="maybe")


def test_planner_flags_are_planner_config():
    p = argparse.ArgumentParser()
    add_spindle_args(p)
    assert planner_config_from_args(p.parse_args([])) == PlannerConfig()
    args = p.parse_args(["--spindle-planner", "wavefront", "--spindle-solver-time-limit", "3", "--spindle-"
                         "cross-level-overlap", "--spindle-distributed-optimizer", "on", "--spindle-sync-aware",
                         "off", "--spindle-solver-deterministic"])
    assert planner_config_from_args(args) == PlannerConfig(planner="wavefront", solver_time_limit=3.0,
                                                           cross_level_overlap=True, distributed_optimizer="on",
                                                           sync_aware="off", solver_deterministic=True)
    action = next(a for a in p._actions if a.dest == "spindle_distributed_optimizer")
    assert tuple(action.choices) == DISTRIBUTED_OPTIMIZER and "ZeRO-1" in action.help
