"""The flat per-unit shard layout of the distributed optimizer (runtime/shards.py), without processes."""

import torch

from megatron_spindle.runtime.shards import UnitShard, add_to_rows, gather_units, row_offsets, settle_rows


def _unit(members: int, index: int) -> tuple[UnitShard, dict[str, torch.Tensor]]:
    tensors = {"u.b": torch.arange(3.0), "u.a": torch.arange(10.0).view(2, 5) + 100}
    keys = sorted(tensors)
    return UnitShard("u", keys, [tensors[k].shape for k in keys], members, index), tensors


def test_shards_tile_the_flattened_unit_by_sorted_index_with_zero_padding():
    sh, tensors = _unit(3, 0)
    flat = sh.flatten(tensors)
    assert sh.numel == 13 and sh.size == 5
    assert torch.equal(flat[:10], tensors["u.a"].reshape(-1)) and torch.equal(flat[10:], tensors["u.b"])
    shards = [UnitShard("u", sh.keys, sh.shapes, 3, i).shard_of(flat) for i in range(3)]
    assert all(s.numel() == 5 for s in shards)
    assert torch.equal(torch.cat(shards)[:13], flat) and torch.equal(shards[2][3:], torch.zeros(2))
    back = sh.unflatten(torch.cat(shards)[:13])
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_unsharded_unit_is_one_shard_and_gathers_without_communication():
    sh, tensors = _unit(1, 0)
    flat = sh.flatten(tensors)
    assert torch.equal(sh.shard_of(flat), flat)
    (full,), = gather_units([sh], [[sh.shard_of(flat)]], group=None)
    assert torch.equal(full, flat)


def test_member_major_rows_hold_each_members_shards_of_every_unit():
    """ZeRO-2's gradient buckets: row j of a bucket's buffer is member j's shards, units side by side, so a
    reduce-scatter (or an all-reduce and this member's row) leaves each member exactly ``shard_of``."""
    a, ta = _unit(3, 0)
    b = UnitShard("v", ["v.w"], [torch.Size([4])], 3, 0)
    tb = {"v.w": torch.arange(4.0) - 10}
    offsets = row_offsets([a, b])
    assert offsets == [0, a.size]
    rows = torch.zeros(3, a.size + b.size)
    for sh, t, off in ((a, ta, offsets[0]), (b, tb, offsets[1])):
        add_to_rows(rows, off, sh, sh.flatten(t))
        add_to_rows(rows, off, sh, sh.flatten(t))  # accumulates
    for j in range(3):
        out = torch.zeros(a.size + b.size)
        settle_rows(out, rows, j, scatter=False)
        for sh, t, off in ((a, ta, offsets[0]), (b, tb, offsets[1])):
            member = UnitShard(sh.unit, sh.keys, sh.shapes, 3, j)
            assert torch.equal(out[off:off + sh.size], 2 * member.shard_of(sh.flatten(t)))
        # a later micro-batch's sum adds to the row: beside it after a reduce-scatter, or this member's row
        settle_rows(out, rows, j, scatter=True, result=rows[j].clone())
        settle_rows(out, rows, j, scatter=False)
        assert torch.equal(out, 3 * rows[j])
