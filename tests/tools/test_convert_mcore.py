"""tools/checkpoint: megatron-core GPT checkpoints (dist_checkpointing torch_dist) in both directions.

One spawned 2-process run serves both:

- loader: TP=2 builds a llama-style GPTModel (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output layer; norms
  perturbed so they are not all ones), saves it as a Megatron-LM checkpoint folder (``iter_0000010`` +
  ``latest_checkpointed_iteration.txt``), then the same processes re-initialise at TP=1, load it with megatron's
  own resharding and rank 0 writes the TP=1 logits. The test converts the checkpoint with ``--loader mcore`` and
  runs our operators on the same tokens.
- saver: before the spawn, a backbone with random weights (q/k/v biases, RoPE base 500000, RMSNorm eps 1e-6) is
  written with ``--saver mcore --target-tensor-parallel-size 2``; the workers build megatron-core's GPTModel from
  the ``args`` in its ``common.pt`` at TP=2 and at TP=1, load it with ``dist_checkpointing.load`` and write their
  logits, which must equal our operators'.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_spindle.checkpointing import load_checkpoint  # noqa: E402
from megatron_spindle.graph.workload import load_workload  # noqa: E402
from tools.checkpoint import convert  # noqa: E402

WORKLOAD = """
name: mcore-test
modules:
  llm:
    kind: llm
    num_layers: 2
    hidden_size: 32
    num_heads: 4
    num_query_groups: 2
    ffn_hidden_size: 48
    frontend: {type: text, vocab_size: 64}
tasks:
  - {name: lm, batch_size: 2, tokens: {llm: 9}, loss: {kind: lm, module: llm}}
"""


SAVER_WORKLOAD = WORKLOAD.replace("    num_query_groups: 2\n", "    num_query_groups: 2\n    qkv_bias: true\n"
                                   "    rotary_base: 500000\n    norm_epsilon: 1.0e-6\n")


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(11))


def _gpt(tp: int, pp: int = 1, pre: bool = True, post: bool = True, args=None):
    """The test's GPT, or (``args``: a Megatron-LM args namespace from a checkpoint) the one those args describe."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = args or argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=48, kv_channels=8, norm_epsilon=1e-5, add_qkv_bias=False,
                                   padded_vocab_size=64, rotary_base=10000)
    cfg = TransformerConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                            num_query_groups=a.num_query_groups, ffn_hidden_size=a.ffn_hidden_size,
                            kv_channels=a.kv_channels, normalization="RMSNorm", layernorm_epsilon=a.norm_epsilon,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            add_qkv_bias=a.add_qkv_bias, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False, batch_p2p_comm=False)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=a.padded_vocab_size,
                    max_sequence_length=16, position_embedding_type="rope", rotary_base=a.rotary_base,
                    share_embeddings_and_output_weights=False, pre_process=pre, post_process=post,
                    parallel_output=False)


def _load_ours_and_log(tp: int, out: str) -> None:
    """Worker side of the saver test: GPTModel from the args our saver wrote, loaded with dist_checkpointing at
    this TP; every rank runs the forward, rank 0 writes the (gathered) logits."""
    from megatron.core import dist_checkpointing

    from tools.checkpoint.loader_mcore import resolve_dir

    folder, _ = resolve_dir(Path(out) / "ours_mcore")  # via latest_checkpointed_iteration.txt
    args = torch.load(folder / "common.pt", weights_only=False)["args"]
    model = _gpt(tp=tp, args=args)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))  # Megatron-LM's nesting
    model.load_state_dict(state["model"])
    tokens = _tokens()
    with torch.no_grad():  # every rank: at TP=2 the forward is collective
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    if torch.distributed.get_rank() == 0:
        torch.save(logits, Path(out) / f"ours_logits_tp{tp}.pt")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_spindle.compat.cpu import apply_cpu_shim

    torch.set_num_threads(1)
    apply_cpu_shim()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ckpt = Path(out) / "mcore"
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(123)
        torch.manual_seed(0)
        model = _gpt(tp=2)
        gen = torch.Generator().manual_seed(7)  # the same on both TP ranks: norms are replicated
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        if rank == 0:
            (ckpt / "iter_0000010").mkdir(parents=True)
            (Path(out) / "mcore_pp2").mkdir()
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(ckpt / "iter_0000010"))
        if rank == 0:
            (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
        _load_ours_and_log(2, out)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1)  # TP=1 (DP=2): the original, resharded
        model = _gpt(tp=1)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(ckpt / "iter_0000010")))
        if rank == 0:
            tokens = _tokens()
            pos = torch.arange(tokens.shape[1]).expand_as(tokens)
            with torch.no_grad():
                logits = model(tokens, pos, None)
            torch.save(logits, Path(out) / "logits_tp1.pt")
        _load_ours_and_log(1, out)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)  # PP=2 copy
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = _gpt(tp=1, pp=2, pre=first, post=last)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(ckpt / "iter_0000010")))
        dist_checkpointing.save(model.sharded_state_dict(), str(Path(out) / "mcore_pp2"))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _convert(tmp_path: Path, source: str, dest: str, loader: str = "mcore", saver: str = "spindle",
             workload: str = "w.yaml", extra: tuple[str, ...] = ()) -> list[str]:
    args = convert.parse_args(["--loader", loader, "--saver", saver, "--workload", str(tmp_path / workload),
                               "--load-dir", str(tmp_path / source), "--save-dir", str(tmp_path / dest), *extra])
    lines: list[str] = []
    args.log = lines.append
    convert.convert(args)
    return lines


def _random_backbone(tmp_path: Path) -> None:
    """A spindle checkpoint of SAVER_WORKLOAD's backbone with random weights (norms around 1, q/k/v biases)."""
    from megatron_spindle.checkpointing import UnitState, save_checkpoint
    from tools.checkpoint.layout import expected_units

    (tmp_path / "saver.yaml").write_text(SAVER_WORKLOAD)
    gen = torch.Generator().manual_seed(3)
    units = {}
    for unit, shapes in expected_units(load_workload(tmp_path / "saver.yaml")).items():
        units[unit] = UnitState({name: torch.randn(shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0)
                                 for name, shape in shapes.items()})
    save_checkpoint(tmp_path / "ours_spindle", 7, units)


def _our_logits(tmp_path: Path, ckpt: str, workload: str = "w.yaml") -> torch.Tensor:
    from megatron_spindle.models import build_operator, metaop_infos

    state = {k: v for u in load_checkpoint(tmp_path / ckpt).units.values() for k, v in u.model.items()}
    workload = load_workload(tmp_path / workload)
    infos = metaop_infos(workload)
    ops = [build_operator(workload, infos[m], 0, infos[m].num_layers) for m in ("lm/llm.frontend", "lm/llm",
                                                                                  "lm/llm.lm_head")]
    for op in ops:
        op.load_full_state(state)
    with torch.no_grad():
        x = ops[1]([ops[0].frontend(_tokens())], None)
        return ops[2].lm_head(x.transpose(0, 1).contiguous()).transpose(0, 1)


@pytest.mark.multiproc
def test_mcore_tp2_checkpoint_gives_tp1_logits(tmp_path, capsys):
    """Loader: also the PP=2 copy (1 layer per stage) converts to the same weights. Saver: our backbone written at
    TP=2 gives our logits in megatron-core's GPTModel at TP=2 and at TP=1 (see _saver_checks)."""
    _random_backbone(tmp_path)
    lines = _convert(tmp_path, "ours_spindle", "ours_mcore", loader="spindle", saver="mcore", workload="saver.yaml",
                     extra=("--target-tensor-parallel-size", "2"))
    assert any("TP=2 x PP=1" in line and "padded to 256" in line for line in lines)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    _saver_checks(tmp_path)
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    lines = _convert(tmp_path, "mcore", "spindle")
    assert any("llm.layers.1" in line for line in lines)  # progress per unit
    assert load_checkpoint(tmp_path / "spindle").metadata["extra"]["source_iteration"] == 10
    ours = _our_logits(tmp_path, "spindle")
    theirs = torch.load(tmp_path / "logits_tp1.pt")
    assert ours.shape == theirs.shape == (2, 9, 64)
    assert float((ours - theirs).norm() / theirs.norm()) <= 1e-5
    _convert(tmp_path, "mcore_pp2", "spindle_pp2")
    a, b = (load_checkpoint(tmp_path / d).units for d in ("spindle", "spindle_pp2"))
    assert sorted(a) == sorted(b)
    for unit in a:
        for name, t in a[unit].model.items():
            assert torch.equal(t, b[unit].model[name]), name

    from tools.checkpoint import inspect_checkpoint as inspect_tool

    assert inspect_tool.main([str(tmp_path / "mcore")]) == 0
    out = capsys.readouterr().out
    assert "iteration: 10" in out and "decoder.layers.mlp.linear_fc1.weight" in out and "(2, 96, 32)" in out

    # An llm declaring `qkv_bias: true`: a checkpoint without biases converts with zero q/k/v biases (exact).
    (tmp_path / "w.yaml").write_text(WORKLOAD.replace("    num_query_groups: 2\n",
                                                      "    num_query_groups: 2\n    qkv_bias: true\n"))
    _convert(tmp_path, "mcore", "spindle_bias")
    biased = load_checkpoint(tmp_path / "spindle_bias").units["llm.layers.0"].model
    assert not biased["llm.layers.0.self_attention.linear_qkv.bias"].any()
    assert float((_our_logits(tmp_path, "spindle_bias") - theirs).norm() / theirs.norm()) <= 1e-5


def _saver_checks(tmp_path: Path) -> None:
    ours = _our_logits(tmp_path, "ours_spindle", "saver.yaml")
    for tp in (2, 1):
        theirs = torch.load(tmp_path / f"ours_logits_tp{tp}.pt")
        assert theirs.shape == (2, 9, 256)  # Megatron-LM's padding: 64 -> a multiple of 128 x TP
        assert float((theirs[..., :64] - ours).norm() / ours.norm()) <= 1e-5, tp
        assert not theirs[..., 64:].any()  # padded rows of the output layer are zero
    folder = tmp_path / "ours_mcore" / "iter_0000007"
    common = torch.load(folder / "common.pt", weights_only=False)
    assert common["iteration"] == 7 and common["args"].tensor_model_parallel_size == 2
    assert common["args"].rotary_base == 500000 and common["args"].add_qkv_bias
    # the chunks are what 2 TP ranks own: q/k/v rows split in two, one chunk per layer and rank
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    qkv = md["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (2, 64, 32) and len(qkv.chunks) == 4
    assert sorted(tuple(c.offsets) for c in qkv.chunks) == [(0, 0, 0), (0, 32, 0), (1, 0, 0), (1, 32, 0)]
    # back with the mcore loader (the padded rows dropped): the same weights; a PP=2 layout too
    _convert(tmp_path, "ours_mcore", "ours_back", workload="saver.yaml", extra=("--true-vocab-size", "64"))
    _convert(tmp_path, "ours_spindle", "ours_mcore_pp2", loader="spindle", saver="mcore", workload="saver.yaml",
             extra=("--target-pipeline-parallel-size", "2", "--make-vocab-size-divisible-by", "1"))
    _convert(tmp_path, "ours_mcore_pp2", "ours_back_pp2", workload="saver.yaml")
    a = load_checkpoint(tmp_path / "ours_spindle").units
    for back in ("ours_back", "ours_back_pp2"):
        b = load_checkpoint(tmp_path / back).units
        assert sorted(a) == sorted(b)
        for unit in a:
            for name, t in a[unit].model.items():
                assert torch.equal(t, b[unit].model[name]), (back, name)
