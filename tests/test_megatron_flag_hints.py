"""Megatron-LM flags the entry points do not take: named with what to give instead."""

from __future__ import annotations

import pytest
from script_loader import load_script

from megatron_spindle.errors import CliArgumentParser
from megatron_spindle.megatron_flags import (
    MEGATRON_FLAG_HINTS,
    MEGATRON_FLAG_PREFIX_HINTS,
    MEGATRON_SWITCHES,
    unrecognized_message,
)


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


def test_families_of_flags_are_hinted_by_prefix():
    msg = unrecognized_message("unrecognized arguments: --moe-router-topk 2 --tp-comm-overlap --ckpt-fully-parallel-save")
    moe, tp_comm, ckpt = msg.split("; ")
    assert moe == "--moe-router-topk is Megatron-LM's, not Spindle's: mixture-of-experts layers are not supported"
    assert tp_comm.startswith("--tp-comm-overlap is Megatron-LM's") and "userbuffers" in tp_comm
    assert "layout-independent format" in ckpt


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
    assert not [f for f in taken if any(f.startswith(prefix) for prefix in MEGATRON_FLAG_PREFIX_HINTS)]


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


# The flags of two of Megatron-LM's own launch scripts (its GPT-3 175B and Llama-3 8B FP8 examples, as
# DISTRIBUTED_ARGS aside they pass them to pretrain_gpt.py), with values our parser accepts where it takes the flag
MEGATRON_LAUNCH_SCRIPTS = {
    "gpt3-175b": """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
        --max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536
        --rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
        --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
        --lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 8
        --pipeline-model-parallel-size 16 --data-path /data/x_text_document --vocab-file v.json --merge-file m.txt
        --split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 --save ck --load ck
        --eval-iters 10 --tensorboard-dir tb""",
    "llama3-8b-fp8": """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
        --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused
        --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
        --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235 --fp8-format hybrid --fp8-amax-history-len 1024
        --fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1
        --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data
        --vocab-size 128256 --data-cache-path cache --tiktoken-pattern v2 --split 99,1,0
        --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1
        --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile --profile-step-start 4
        --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 --save ck --load ck
        --tensorboard-dir tb""",
    # examples/multimodal/pretrain_mistral_clip.sh: LLaVA's first stage (ViT and LLM frozen, from a combined
    # pretrained checkpoint)
    "llava-mistral-clip": """--img-embedding-idx 1 --apply-layernorm-1p --attention-softmax-in-fp32
        --use-checkpoint-args --use-distributed-optimizer --transformer-impl transformer_engine --use-te
        --normalization RMSNorm --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion --num-workers 2
        --exit-duration-in-mins 230 --use-flash-attn --untie-embeddings-and-output-weights --disable-bias-linear
        --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000 --swiglu --attention-dropout 0.0
        --hidden-dropout 0.0 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --num-layers 32
        --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 4096
        --ffn-hidden-size 14336 --micro-batch-size 1 --global-batch-size 256 --lr-decay-iters 20000
        --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --log-interval 10
        --eval-iters 10 --eval-interval 1000 --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok
        --data-path vision_text=data --valid-path data.yaml --prompt-path prompts.json --save-interval 1000 --save ck
        --load ck --dataloader-save ck/dataloader --pretrained-checkpoint pre --split 100,0,0 --clip-grad 1.0
        --weight-decay 1e-2 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.014 --log-params-norm
        --log-num-zeros-in-grad --bf16 --eod-mask-loss --freeze-LM --freeze-ViT --patch-dim 14 --img-h 336
        --img-w 336 --dataloader-type external --tensorboard-dir tb --language-model-type=mistral_7b
        --disable-vision-class-token --distributed-timeout-minutes 60
        --allow-missing-vision-projection-checkpoint""",
    # examples/multimodal/nvlm/sft_34b_internvit.sh: NVLM's SFT (tiled images, a frozen ViT), its flags beyond the above
    "nvlm-sft-34b": """--seq-length 261 --decoder-seq-length 3200 --tokenizer-prompt-format chatml --vocab-size 64000
        --make-vocab-size-divisible-by 1 --language-model-type yi-34b --vision-model-type internvit
        --train-samples 30000000 --lr-decay-samples 25600000 --lr-warmup-samples 83200 --freeze-ViT --ckpt-format torch
        --pixel-shuffle --use-tiling --max-num-tiles 6 --use-thumbnail --use-tile-tags --use-image-tag
        --pretrained-checkpoint pre --log-num-zeros-in-grad""",
}


@pytest.mark.parametrize("script", sorted(MEGATRON_LAUNCH_SCRIPTS))
def test_megatron_lm_launch_script_flags_are_taken_or_hinted(script, capsys):
    """A Megatron-LM launch script's flags given to pretrain_multitask.py: each is either taken or named with
    what to give instead; none is left as a bare unrecognized argument."""
    argv = ["--workload", "tiny-clip", "--train-iters", "10"] + MEGATRON_LAUNCH_SCRIPTS[script].split()
    with pytest.raises(SystemExit) as e:
        load_script("pretrain_multitask.py").main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "unrecognized arguments" not in err, err
    hinted = [part.split(" ", 1)[0] for part in err.split(": error: ", 1)[1].split("; ")]
    given = {a.split("=", 1)[0] for a in argv}  # --flag=value as one argument
    assert hinted and set(hinted) <= set(MEGATRON_FLAG_HINTS) and set(hinted) <= given, hinted


def test_megatron_lm_tokenizer_types_are_answered(capsys):
    """Megatron-LM's other tokenizer types (a Mistral, Llama, SentencePiece or TikToken one) name what reads them."""
    with pytest.raises(SystemExit) as e:
        load_script("pretrain_multitask.py").main(["--workload", "tiny-clip", "--tokenizer-type", "MistralTokenizer"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "'MistralTokenizer' is not one of ByteTokenizer, HuggingFaceTokenizer, GPT2BPETokenizer" in err
    assert "give HuggingFaceTokenizer with --tokenizer-model FOLDER" in err
