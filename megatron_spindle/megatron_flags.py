"""Megatron-LM flags that Spindle's entry points do not take, and what to give instead.

A user who brings a Megatron-LM launch script gets, for each such flag, why it is not there and what replaces it,
rather than argparse's bare "unrecognized arguments" (``CliArgumentParser(megatron_flags=True)``).
"""

from __future__ import annotations

import re
from collections.abc import Collection


def _workload_field(field: str, modules: str = "each transformer module") -> str:
    return f"the model comes from --workload: set `{field}` on {modules} in the workload YAML"


_NO_PIPELINE = ("Spindle has no pipeline stages: the planner splits a MetaOp's layers into slices that run in "
                "successive waves, each on devices of its own")

MEGATRON_FLAG_HINTS: dict[str, str] = {
    # parallelism: the planner's, per slice
    "--tensor-model-parallel-size": "the planner chooses each slice's tensor-parallel degree (the plan's tp x dp), "
                                    "not one TP for the job",
    "--pipeline-model-parallel-size": _NO_PIPELINE,
    "--virtual-pipeline-model-parallel-size": _NO_PIPELINE,
    "--num-layers-per-virtual-pipeline-stage": _NO_PIPELINE,
    "--context-parallel-size": "context parallelism is not supported (--sequence-parallel splits the sequence of "
                               "the norms and dropouts within a slice's TP group)",
    "--expert-model-parallel-size": "mixture-of-experts layers are not supported",
    "--num-experts": "mixture-of-experts layers are not supported",
    "--use-torch-fsdp2": "the planner shards optimizer state, gradients and weights itself where memory needs it "
                         "(--spindle-distributed-optimizer auto: ZeRO-1 to 3)",
    "--distributed-backend": "the backend follows the device: NCCL on GPUs, gloo on CPUs",
    # the model: the workload's
    "--num-layers": _workload_field("num_layers"),
    "--hidden-size": _workload_field("hidden_size", "each module"),
    "--ffn-hidden-size": _workload_field("ffn_hidden_size"),
    "--num-attention-heads": _workload_field("num_heads"),
    "--num-query-groups": _workload_field("num_query_groups"),
    "--group-query-attention": _workload_field("num_query_groups"),
    "--swiglu": "the workload's llm modules run SwiGLU MLPs, its encoders ungated MLPs of their `activation` "
                "(gelu, quick_gelu or silu)",
    "--add-qkv-bias": _workload_field("qkv_bias: true", "an llm module"),
    "--rotary-base": _workload_field("rotary_base", "an llm module"),
    "--vocab-size": _workload_field("vocab_size", "the text front end or the llm module"),
    "--seq-length": "tokens per sample are set per task and module: each task's `tokens` in the workload YAML",
    # implementation
    "--use-flash-attn": "give --attention-backend flash (Megatron-LM's replacement for this flag)",
    "--transformer-impl": "the layers use Transformer Engine's spec where TE is installed and megatron-core's local "
                          "spec otherwise or with --attention-backend local",
    "--recompute-activations": "give --recompute-granularity selective (what Megatron-LM's flag sets), or leave "
                               "--spindle-recompute auto to the planner",
    "--fp8-format": "FP8 training is not supported: --bf16 or --fp16",
    # schedule: in iterations
    "--train-samples": "give --train-iters: Spindle counts iterations (each of --global-batch-size samples)",
    "--lr-warmup-samples": "give --lr-warmup-iters: Spindle counts iterations",
    "--lr-warmup-fraction": "give --lr-warmup-iters: Spindle counts iterations",
    "--lr-decay-samples": "give --lr-decay-iters: Spindle counts iterations",
    "--rampup-batch-size": "batch size ramp-up is not supported: --global-batch-size holds for the whole run",
    # checkpoints
    "--ckpt-format": "checkpoints are Spindle's own layout-independent format (tools/checkpoint/convert.py "
                     "--saver mcore writes a torch_dist checkpoint from one)",
}

# the flags above that take no value
MEGATRON_SWITCHES = frozenset({"--swiglu", "--group-query-attention", "--add-qkv-bias", "--use-flash-attn",
                               "--recompute-activations", "--use-torch-fsdp2"})


def _hint(flag: str, taken: Collection[str] | None) -> str:
    """The flag's hint; one that says to give a flag this tool does not take (``taken``: its flags) names the
    tool that does."""
    hint = MEGATRON_FLAG_HINTS[flag]
    given = re.match(r"give (--[a-z0-9-]+)", hint)
    if taken is not None and given and given.group(1) not in taken:
        hint += " (on pretrain_multitask.py: this tool does not train)"
    return f"{flag} is Megatron-LM's, not Spindle's: {hint}"


def unrecognized_message(message: str, taken: Collection[str] | None = None) -> str:
    """argparse's ``unrecognized arguments: ...`` message with a hint for each Megatron-LM flag in it
    (``--flag`` or ``--flag=value``); the other arguments stay listed as unrecognized. Any other message is
    returned as it is. The parts are joined by "; ", which no hint contains. ``taken``: the flags of the tool
    (``_hint``)."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    hinted, rest, value_of_hinted = [], [], False
    for arg in message[len(prefix):].split():
        flag = arg.split("=", 1)[0]
        if flag in MEGATRON_FLAG_HINTS:
            hinted.append(_hint(flag, taken))
            value_of_hinted = "=" not in arg and flag not in MEGATRON_SWITCHES
        elif value_of_hinted and not arg.startswith("--"):
            value_of_hinted = False  # the hinted flag's value
        else:
            value_of_hinted = False
            rest.append(arg)
    if not hinted:
        return message
    return "; ".join(hinted + ([prefix + " ".join(rest)] if rest else []))
