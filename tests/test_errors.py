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
