"""runtime/groups.py's new_group_in_order on a torch whose new_group has no ``sort_ranks`` (before 2.13; the GPU
image's 2.11 failed there): sorted device tuples still get their groups, an unsorted one stops with one line."""

import pytest

from megatron_spindle.runtime import groups


def _new_group_without_sort_ranks(calls):
    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                  group_desc=None, device_id=None):
        calls.append(list(ranks))
        return ("group", tuple(ranks))
    return new_group


def test_an_older_torch_gets_sorted_groups_and_refuses_an_order_it_would_lose(monkeypatch):
    calls = []
    monkeypatch.setattr(groups.dist, "new_group", _new_group_without_sort_ranks(calls))
    monkeypatch.setattr(groups, "group_timeout", lambda: None)
    assert groups.new_group_in_order((0,)) == ("group", (0,))
    assert groups.new_group_in_order((1, 3)) == ("group", (1, 3))
    with pytest.raises(RuntimeError, match=r"orders the devices of a process group as \[3, 1\].*torch >= 2.13"):
        groups.new_group_in_order((3, 1))
    assert calls == [[0], [1, 3]]  # the refused group was not created: no rank waits in a half-made collective


def test_a_torch_with_sort_ranks_keeps_the_plan_order(monkeypatch):
    seen = []
    monkeypatch.setattr(groups.dist, "new_group", lambda ranks, sort_ranks=True, timeout=None:
                        seen.append((list(ranks), sort_ranks)))
    monkeypatch.setattr(groups, "group_timeout", lambda: None)
    groups.new_group_in_order((3, 1))
    assert seen == [([3, 1], False)]
