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
    reduce-scatter (or an all-reduce and this member's row) leaves each member exactly ``shard_of``; units whose
    last member's row is partly padding (``u``) and whose members' rows are all full (``v``)."""
    a, ta = _unit(3, 0)
    b = UnitShard("v", ["v.w"], [torch.Size([4])], 3, 0)
    tb = {"v.w": torch.arange(4.0) - 10}
    offsets = row_offsets([a, b])
    assert offsets == [0, a.size]
    rows = torch.zeros(3, a.size + b.size)
    for sh, t, off in ((a, ta, offsets[0]), (b, tb, offsets[1])):
        add_to_rows(rows, off, sh, t)
        add_to_rows(rows, off, sh, t)  # accumulates
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


def test_bf16_tensors_add_into_the_fp32_rows_as_their_fp32_casts():
    """The runtime's bf16 gradients go into fp32 staging rows without a cast per tensor: the same values."""
    sh, tensors = _unit(2, 0)
    bf16 = {k: (t / 7).to(torch.bfloat16) for k, t in tensors.items()}
    direct, cast = torch.zeros(2, sh.size), torch.zeros(2, sh.size)
    add_to_rows(direct, 0, sh, bf16)
    add_to_rows(cast, 0, sh, {k: t.float() for k, t in bf16.items()})
    assert direct.dtype == torch.float32 and torch.equal(direct, cast)
    assert torch.equal(direct.reshape(-1)[:sh.numel], sh.flatten(bf16))


def test_unflatten_keeps_every_shape_an_empty_tensor_included():
    shapes = [torch.Size([2, 3]), torch.Size([0, 4]), torch.Size([5])]
    sh = UnitShard("u", ["u.a", "u.b", "u.c"], shapes, 1, 0)
    flat = torch.arange(11.0)
    out = sh.unflatten(flat)
    assert [out[k].shape for k in sh.keys] == shapes
    assert torch.equal(out["u.c"], flat[6:]) and out["u.a"].data_ptr() == flat.data_ptr()  # views of flat
