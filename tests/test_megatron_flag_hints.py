"""Megatron-LM flags the entry points do not take: named with what to give instead."""

from __future__ import annotations

import pytest
from script_loader import load_script

from megatron_spindle.errors import CliArgumentParser
from megatron_spindle.megatron_flags import MEGATRON_FLAG_HINTS, MEGATRON_SWITCHES, unrecognized_message


def test_other_messages_and_unknown_flags_pass_through():
    assert unrecognized_message("argument --lr: invalid float value: 'x'") == "argument --lr: invalid float value: 'x'"
    assert unrecognized_message("unrecognized arguments: --foo 3") == "unrecognized arguments: --foo 3"


def test_hint_per_megatron_flag_and_their_values_dropped():
    msg = unrecognized_message("unrecognized arguments: --tensor-model-parallel-size 2 --foo 3 "
                               "--num-layers=4 --swiglu bar")
    tp, layers, swiglu, rest = msg.split("; ")
    assert tp == f"--tensor-model-parallel-size is Megatron-LM's, not Spindle's: " \
                 f"{MEGATRON_FLAG_HINTS['--tensor-model-parallel-size']}"
    assert layers.startswith("--num-layers is Megatron-LM's") and "`num_layers`" in layers
    assert swiglu.startswith("--swiglu is Megatron-LM's")
    # 2 is the TP flag's value, 3 belongs to --foo, --num-layers=4 carries its own, a switch takes none
    assert rest == "unrecognized arguments: --foo 3 bar"


def test_a_replacement_the_tool_lacks_names_the_tool_that_has_it():
    msg = "unrecognized arguments: --train-samples 10 --use-flash-attn"
    taken = {"--attention-backend", "--workload"}  # tools/plan.py's kind: no --train-iters
    samples, flash = unrecognized_message(msg, taken).split("; ")
    assert samples.endswith("give --train-iters: Spindle counts iterations (each of --global-batch-size samples) "
                            "(on pretrain_multitask.py: this tool does not train)")
    assert flash.endswith("give --attention-backend flash (Megatron-LM's replacement for this flag)")
    assert "this tool does not train" not in unrecognized_message(msg, taken | {"--train-iters"})


def test_table():
    assert MEGATRON_SWITCHES <= set(MEGATRON_FLAG_HINTS)
    assert not [f for f, hint in MEGATRON_FLAG_HINTS.items() if ";" in hint or not f.startswith("--")]


class _Parser(BaseException):  # carries an entry point's finished parser out of its main
    pass


def _raise_parser(parser):
    raise _Parser(parser)


@pytest.mark.parametrize("script", ["pretrain_multitask.py", "tools/plan.py", "tools/compare.py",
                                    "tools/profile_metaops.py"])
def test_entry_point_hints_no_flag_it_takes(script, capsys):
    """Each Megatron-style entry point hints, and no hinted flag is one it defines (its hint would be wrong)."""
    with pytest.raises(_Parser) as got:
        load_script(script).main(["--help"], extra_args_provider=_raise_parser)
    parser = got.value.args[0]
    assert parser.megatron_flags
    taken = {s for a in parser._actions for s in a.option_strings}
    assert "--workload" in taken and not taken & set(MEGATRON_FLAG_HINTS)


@pytest.mark.parametrize("megatron_flags", [True, False])
def test_parser_option(capsys, megatron_flags):
    parser = CliArgumentParser(prog="p", megatron_flags=megatron_flags)
    parser.add_argument("--lr", type=float)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--lr", "1", "--use-flash-attn"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    hint = "p: error: --use-flash-attn is Megatron-LM's, not Spindle's: give --attention-backend flash"
    assert (hint in err) == megatron_flags
    assert ("unrecognized arguments: --use-flash-attn" in err) != megatron_flags
    assert err.count("\n") == 1
