"""Megatron-LM flags that Spindle's entry points do not take, and what to give instead.

A user who brings a Megatron-LM launch script gets, for each such flag, why it is not there and what replaces it,
rather than argparse's bare "unrecognized arguments" (``CliArgumentParser(megatron_flags=True)``).
"""

from __future__ import annotations

import re
from collections.abc import Collection


def _workload_field(field: str, modules: str = "each transformer module") -> str:
    return f"the model comes from --workload: set `{field}` on {modules} in the workload YAML"


_POSITIONS = ("front ends add learned positions (Whisper's audio stem: sinusoids) and llm modules rotary ones "
              "(`rotary_base`, `rope_scaling_factor` in the workload YAML)")
_IMAGE_SHAPE = "image front ends take `image_size` and `patch_size` from the module's `frontend:` in the workload YAML"
_FUSIONS = ("kernel fusions follow the layer spec: Transformer Engine's where it is installed, megatron-core's local "
            "spec otherwise (--attention-backend picks the attention)")
_ADAMW = "the optimizer is AdamW (--adam-beta1, --adam-beta2, --adam-eps, --weight-decay)"
_FP32_STATE = "the optimizer keeps fp32 master weights, gradients and moments"
_LR_FROM_FLAGS = ("the LR schedule always comes from this run's flags (a function of the iteration, not stored in "
                  "checkpoints)")
_BPE_FILES = ("tiktoken vocabularies are not read: give --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
              "FOLDER (a Hugging Face tokenizer) or GPT2BPETokenizer with --vocab-file and --merge-file")
_UNPACKED = ("a sample is one padded row of its task's batch (documents are not packed): no EOD masks or position "
             "resets to make")
_LOGGERS = "one-logger is not supported: --tensorboard-dir or --wandb-project"
_CKPT_FORMAT = ("checkpoints are Spindle's own layout-independent format (tools/checkpoint/convert.py --saver mcore "
                "writes a torch_dist checkpoint from one)")

_NO_TILING = ("images are not tiled: an image is its patch front end's input, resized when decoded to the size the "
              "task's `tokens` give it (--image-processor)")
_MODULES_FROM_WORKLOAD = ("the model comes from --workload: its modules of kind llm and encoder "
                          "(tools/checkpoint/workload_from_hf.py writes them from Hugging Face configs)")
_NO_FP8 = "FP8 training is not supported: --bf16 or --fp16"
_ONE_LR = "one learning rate schedule drives every parameter: --lr and --min-lr"

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
    "--fp8-format": _NO_FP8,
    "--fp8-amax-history-len": _NO_FP8,
    "--fp8-amax-compute-algo": _NO_FP8,
    "--fp8-param-gather": _NO_FP8,
    "--cross-entropy-loss-fusion": "the LM loss is megatron-core's vocab-parallel cross entropy, unfused",
    # schedule: in iterations
    "--train-samples": "give --train-iters: Spindle counts iterations (each of --global-batch-size samples)",
    "--lr-warmup-samples": "give --lr-warmup-iters: Spindle counts iterations",
    "--lr-warmup-fraction": "give --lr-warmup-iters: Spindle counts iterations",
    "--lr-decay-samples": "give --lr-decay-iters: Spindle counts iterations",
    "--rampup-batch-size": "batch size ramp-up is not supported: --global-batch-size holds for the whole run",
    "--max-position-embeddings": "position tables follow each task's `tokens` in the workload YAML (front ends "
                                 "learn theirs, llm modules use rotary embeddings)",
    "--position-embedding-type": _POSITIONS,
    "--use-rotary-position-embeddings": _POSITIONS,
    "--rotary-percent": "llm modules rotate the whole head dimension (rotary percent 1.0)",
    "--kv-channels": "a head's width is the module's hidden_size / num_heads in the workload YAML",
    "--normalization": "encoders use LayerNorm and llm modules RMSNorm (the module's kind decides, "
                       "`norm_epsilon` sets the epsilon)",
    "--norm-epsilon": _workload_field("norm_epsilon", "a module"),
    "--apply-layernorm-1p": "zero-centred (1p) layer norms are not supported",
    "--qk-layernorm": "query-key layer norms are not supported",
    "--disable-bias-linear": "encoders' linear layers have biases and llm modules' have none (the module's kind "
                             "decides, `qkv_bias: true` adds q/k/v biases to an llm module)",
    "--untie-embeddings-and-output-weights": "an LM head's output layer always has weights of its own, untied from "
                                             "the text embeddings",
    "--make-vocab-size-divisible-by": "the vocabulary is the workload's `vocab_size` (on the text front end or the "
                                      "llm module), used as it is",
    "--patch-dim": _IMAGE_SHAPE,
    "--img-h": _IMAGE_SHAPE,
    "--img-w": _IMAGE_SHAPE,
    # kernels: the layer spec's
    "--no-masked-softmax-fusion": _FUSIONS,
    "--no-bias-gelu-fusion": _FUSIONS,
    "--no-bias-dropout-fusion": _FUSIONS,
    "--no-gradient-accumulation-fusion": _FUSIONS,
    "--attention-softmax-in-fp32": _FUSIONS,
    "--deterministic-mode": "a deterministic mode is not supported",
    # optimizer and schedule
    "--optimizer": _ADAMW,
    "--sgd-momentum": _ADAMW,
    "--use-precision-aware-optimizer": _FP32_STATE,
    "--main-grads-dtype": "the main gradients are fp32, or bf16 with --grad-reduce-in-bf16 (cast to fp32 for the "
                          "step), and the optimizer keeps fp32 master weights and moments",
    "--main-params-dtype": _FP32_STATE,
    "--exp-avg-dtype": _FP32_STATE,
    "--exp-avg-sq-dtype": _FP32_STATE,
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and all-reduced in fp32 by default "
                                            "(--grad-reduce-in-bf16: in bf16)",
    "--decoupled-lr": _ONE_LR,
    "--decoupled-min-lr": _ONE_LR,
    "--ddp-average-in-collective": "a unit's gradients are summed over the slices and replicas holding it (each "
                                   "task's loss is already a mean over its global batch): nothing to average",
    "--override-opt_param-scheduler": _LR_FROM_FLAGS,
    "--use-checkpoint-opt_param-scheduler": _LR_FROM_FLAGS,
    # data: tar shards per task
    "--train-data-path": "give --data-path TASK=PATH (tar shards of each task, tools/build_multitask_dataset.py)",
    "--data-cache-path": "the shard index is memory-mapped where it lies: no index cache is built",
    "--num-dataset-builder-threads": "shard folders are opened, not built, at start (tools/build_multitask_dataset.py "
                                     "--workers builds them beforehand)",
    "--dataloader-type": "each task's samples come in a seeded order per epoch (data/sampler.py), resumed exactly "
                         "from checkpoints",
    "--no-create-attention-mask-in-dataloader": _UNPACKED,
    "--eod-mask-loss": _UNPACKED,
    "--reset-position-ids": _UNPACKED,
    "--reset-attention-mask": _UNPACKED,
    "--tokenizer-prompt-format": "prompt formats are not applied: text is tokenized as it is stored",
    "--tiktoken-pattern": _BPE_FILES,
    "--no-mmap-bin-files": "the shard index is always memory-mapped",
    # multimodal (Megatron-LM's examples/multimodal)
    "--freeze-LM": "give --freeze MODULE ... with the workload's module names (e.g. --freeze llm)",
    "--freeze-ViT": "give --freeze MODULE ... with the workload's module names (e.g. --freeze vision)",
    "--language-model-type": _MODULES_FROM_WORKLOAD,
    "--vision-model-type": _MODULES_FROM_WORKLOAD,
    "--img-embedding-idx": ("a module's inputs are the outputs of the modules that flow into it, in the order of "
                            "the task's flows, then its own text (the workload's `flows` and `tokens`)"),
    "--disable-vision-class-token": "set `class_token: false` on the vision module's `frontend:` in the workload YAML",
    "--use-te": ("the layers use Transformer Engine's spec where TE is installed and megatron-core's local spec "
                 "otherwise or with --attention-backend local"),
    "--valid-path": "give --valid-data-path TASK=PATH (or --split)",
    "--prompt-path": ("prompts are not added while training: a sample's text is trained as "
                      "tools/build_multitask_dataset.py stored it"),
    "--dataloader-save": "every task's data position is saved in each checkpoint and resumed exactly",
    "--pixel-shuffle": ("fewer image tokens into the LLM come from a projector's `pool` in the workload YAML (QWen-VAL "
                        "pools 1024 vision tokens to 256)"),
    "--use-tiling": _NO_TILING,
    "--max-num-tiles": _NO_TILING,
    "--use-thumbnail": _NO_TILING,
    "--use-tile-tags": _NO_TILING,
    "--use-image-tag": _NO_TILING,
    "--allow-missing-vision-projection-checkpoint": (
        "tools/checkpoint/convert.py writes every unit of the workload, those its sources lack (the projectors of "
        "an LLM and a ViT from separate checkpoints) initialised as a fresh run initialises them"),
    # logging
    "--tensorboard-log-interval": "TensorBoard gets the means of each --log-interval at its log line",
    "--timing-log-option": "timers print as (min, max) over the ranks (--timing-log-level)",
    "--no-barrier-with-level-1-timing": "the level-1 timers synchronise CUDA at their boundaries and add no barrier",
    "--log-straggler": "straggler detection is not supported (the log's per-wave times are each wave's slowest "
                       "rank)",
    "--enable-one-logger": _LOGGERS,
    "--one-logger-project": _LOGGERS,
    "--empty-unused-memory-level": "emptying the CUDA cache between steps is not supported",
    # checkpoints
    "--ckpt-format": _CKPT_FORMAT,
    "--use-dist-ckpt": _CKPT_FORMAT,
    "--auto-detect-ckpt-format": "--load reads Spindle checkpoints: convert others with tools/checkpoint/convert.py "
                                 "(--loader mcore or hf)",
    "--dist-ckpt-strictness": "a checkpoint's units are checked against the model's on load (units of tasks "
                              "added or dropped are reported, not errors)",
    "--async-save": "checkpoints are saved synchronously",
    "--non-persistent-save-interval": "non-persistent checkpoints are not supported: --save-interval",
    "--save-retain-interval": "no checkpoint is deleted: each --save-interval one is kept",
    "--use-checkpoint-args": "the model comes from --workload (a checkpoint records the workload's digest, checked "
                             "at --load), not from the checkpoint's flags",
    "--ckpt-step": "give --load an iteration folder (e.g. --load CKPT/iter_0000100)",
    "--use-legacy-models": "the models are megatron-core's only",
    "--spec": _FUSIONS,
    "--no-persist-layer-norm": _FUSIONS,
    "--no-rope-fusion": _FUSIONS,
    "--apply-rope-fusion": _FUSIONS,
    "--masked-softmax-fusion": _FUSIONS,
    "--bias-swiglu-fusion": _FUSIONS,
    "--no-bias-swiglu-fusion": _FUSIONS,
    "--gradient-accumulation-fusion": _FUSIONS,
    "--overlap-p2p-communication": _NO_PIPELINE,
    "--use-ring-exchange-p2p": _NO_PIPELINE,
    "--pipeline-model-parallel-layout": _NO_PIPELINE,
    "--decoder-first-pipeline-num-layers": _NO_PIPELINE,
    "--decoder-last-pipeline-num-layers": _NO_PIPELINE,
    "--account-for-embedding-in-pipeline-split": _NO_PIPELINE,
    "--account-for-loss-in-pipeline-split": _NO_PIPELINE,
    "--encoder-seq-length": "tokens per sample are set per task and module: each task's `tokens` in the workload YAML",
    "--decoder-seq-length": "tokens per sample are set per task and module: each task's `tokens` in the workload YAML",
    "--encoder-num-layers": _workload_field("num_layers"),
    "--decoder-num-layers": _workload_field("num_layers"),
    "--mmap-bin-files": "the shard index is always memory-mapped",
    "--optimizer-cpu-offload": "optimizer CPU offload is not supported (the planner shards the optimizer state "
                               "where memory needs it: --spindle-distributed-optimizer)",
    "--multi-latent-attention": "multi-latent attention is not supported",
}

# families of Megatron-LM flags, by prefix, where no single flag above names them
MEGATRON_FLAG_PREFIX_HINTS: dict[str, str] = {
    "--moe-": "mixture-of-experts layers are not supported",
    "--mamba-": "Mamba layers are not supported",
    "--retro-": "Retro is not supported",
    "--fp8-": _NO_FP8,
    "--fp4-": _NO_FP8,
    "--tp-comm-": "overlapping TP communication with GEMMs (Transformer Engine's userbuffers) is not supported",
    "--cuda-graph": "CUDA graphs are not supported",
    "--inference-": "pretrain_multitask.py trains; inference is not supported",
    "--mtp-": "multi-token prediction is not supported",
    "--ckpt-": _CKPT_FORMAT,
    "--dist-ckpt-": _CKPT_FORMAT,
    "--rerun-": "the rerun state machine is not supported (a non-finite loss stops the run: "
                "--no-check-for-nan-in-loss-and-grad)",
    "--pin-cpu-": "optimizer CPU offload is not supported",
}


def megatron_hint(flag: str) -> str | None:
    """The hint of a Megatron-LM flag (by name, else by family), or None for any other flag."""
    if flag in MEGATRON_FLAG_HINTS:
        return MEGATRON_FLAG_HINTS[flag]
    return next((h for prefix, h in MEGATRON_FLAG_PREFIX_HINTS.items() if flag.startswith(prefix)), None)

# the flags above that take several values
MEGATRON_NARGS = {"--rampup-batch-size": 3}

# the flags above that take no value
MEGATRON_SWITCHES = frozenset({
    "--swiglu", "--group-query-attention", "--add-qkv-bias", "--use-flash-attn", "--recompute-activations",
    "--use-torch-fsdp2", "--use-rotary-position-embeddings", "--apply-layernorm-1p", "--qk-layernorm",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
    "--attention-softmax-in-fp32", "--deterministic-mode", "--use-precision-aware-optimizer",
    "--accumulate-allreduce-grads-in-fp32", "--ddp-average-in-collective", "--override-opt_param-scheduler",
    "--use-checkpoint-opt_param-scheduler", "--no-create-attention-mask-in-dataloader", "--eod-mask-loss",
    "--reset-position-ids", "--reset-attention-mask",
    "--no-barrier-with-level-1-timing", "--log-straggler", "--enable-one-logger", "--use-dist-ckpt",
    "--auto-detect-ckpt-format", "--async-save", "--use-checkpoint-args", "--fp8-param-gather",
    "--cross-entropy-loss-fusion", "--no-mmap-bin-files", "--use-legacy-models",
    "--no-persist-layer-norm", "--no-rope-fusion", "--apply-rope-fusion", "--masked-softmax-fusion",
    "--bias-swiglu-fusion", "--no-bias-swiglu-fusion", "--gradient-accumulation-fusion", "--overlap-p2p-communication",
    "--use-ring-exchange-p2p", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--mmap-bin-files", "--optimizer-cpu-offload", "--multi-latent-attention", "--freeze-LM", "--freeze-ViT",
    "--disable-vision-class-token", "--use-te", "--allow-missing-vision-projection-checkpoint", "--pixel-shuffle",
    "--use-tiling", "--use-thumbnail", "--use-tile-tags", "--use-image-tag"})


def _hint(flag: str, taken: Collection[str] | None) -> str:
    """The flag's hint; one that says to give a flag this tool does not take (``taken``: its flags) names the
    tool that does."""
    hint = megatron_hint(flag)
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
    hinted, rest, values_left = [], [], 0
    for arg in message[len(prefix):].split():
        flag = arg.split("=", 1)[0]
        if megatron_hint(flag) is not None:
            hinted.append(_hint(flag, taken))
            values_left = 0 if "=" in arg or flag in MEGATRON_SWITCHES else MEGATRON_NARGS.get(flag, 1)
        elif values_left and not arg.startswith("--"):
            values_left -= 1  # a value of the hinted flag
        else:
            values_left = 0
            rest.append(arg)
    if not hinted:
        return message
    return "; ".join(hinted + ([prefix + " ".join(rest)] if rest else []))
