"""The one-line error printer: ranks share the launcher's stderr, so each line must reach it in one write."""

from __future__ import annotations

import io

import pytest

from megatron_spindle import errors


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_error_line_and_its_newline_are_one_write(monkeypatch):
    out = _Writes()
    monkeypatch.setattr(errors.sys, "stderr", out)
    with pytest.raises(SystemExit) as e:
        errors.fail("prog", "rank 1 is dead\n(pid 7)")
    assert e.value.code == 2
    assert out.calls == ["prog: error: rank 1 is dead (pid 7)\n"]


def _exit(fn) -> int:
    with pytest.raises(SystemExit) as e:
        fn()
    return e.value.code


@pytest.mark.parametrize("local_rank, prints_alike", [(None, True), ("0", True), ("1", False), ("7", False)])
def test_an_error_every_rank_raises_alike_is_printed_once_per_node(monkeypatch, local_rank, prints_alike):
    """torchrun's first worker of a node prints it; the others exit with the same status, silently. An error of
    one rank's own is printed wherever it happens."""
    out = _Writes()
    monkeypatch.setattr(errors.sys, "stderr", out)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert errors.prints_errors_of_every_rank() == prints_alike

    def alike():
        with errors.exit_on_user_error("prog"), errors.alike_on_every_rank():
            raise ValueError("bad flag value")

    def agreed():
        with errors.exit_on_user_error("prog"):
            raise errors.on_every_rank(FileNotFoundError("--load x: no checkpoint"))

    def own():
        with errors.exit_on_user_error("prog"):
            raise ValueError("this rank's own")

    def parser():
        errors.CliArgumentParser(prog="prog").parse_args(["--nope"])

    assert [_exit(f) for f in (alike, agreed, own, parser)] == [2, 2, 2, 2]
    alike_lines = ["prog: error: bad flag value\n", "prog: error: --load x: no checkpoint\n"]
    parser_line = ["prog: error: unrecognized arguments: --nope (see --help)\n"]
    own_line = ["prog: error: this rank's own\n"]
    assert out.calls == (alike_lines + own_line + parser_line if prints_alike else own_line)


def test_alike_marks_only_user_errors():
    with pytest.raises(KeyError) as e, errors.alike_on_every_rank():
        raise KeyError("a bug")
    assert not hasattr(e.value, "spindle_on_every_rank")
