"""tools/checkpoint: a megatron-core GPT checkpoint (dist_checkpointing torch_dist, saved at TP=2 by 2 gloo
processes) converts into our LLM backbone and gives the TP=1 original's logits.

One spawned 2-process run: TP=2 builds a llama-style GPTModel (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied
output layer; norms perturbed so they are not all ones), saves it as a Megatron-LM checkpoint folder
(``iter_0000010`` + ``latest_checkpointed_iteration.txt``), then the same processes re-initialise at TP=1, load it
with megatron's own resharding and rank 0 writes the TP=1 logits. The test converts the checkpoint with
``--loader mcore`` and runs our operators on the same tokens.
"""

from __future__ import annotations

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


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(11))


def _gpt(tp: int, pp: int = 1, pre: bool = True, post: bool = True):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, kv_channels=8, normalization="RMSNorm", layernorm_epsilon=1e-5,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
                            masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False, batch_p2p_comm=False)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=16,
                    position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False,
                    pre_process=pre, post_process=post)


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


def _convert(tmp_path: Path, source: str, dest: str) -> list[str]:
    args = convert.parse_args(["--loader", "mcore", "--saver", "spindle", "--workload", str(tmp_path / "w.yaml"),
                               "--load-dir", str(tmp_path / source), "--save-dir", str(tmp_path / dest)])
    lines: list[str] = []
    args.log = lines.append
    convert.convert(args)
    return lines


def _our_logits(tmp_path: Path, ckpt: str) -> torch.Tensor:
    from megatron_spindle.models import build_operator, metaop_infos

    state = {k: v for u in load_checkpoint(tmp_path / ckpt).units.values() for k, v in u.model.items()}
    workload = load_workload(tmp_path / "w.yaml")
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
    """Also the PP=2 copy (1 layer per stage) converts to the same weights."""
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
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
