"""Saver plugin ``mcore``: the workload's LLM backbone -> a megatron-core GPT checkpoint (``dist_checkpointing``,
torch_dist format) laid out as a run at ``--target-tensor-parallel-size`` x ``--target-pipeline-parallel-size``
writes it, loadable by megatron-core's ``GPTModel`` (and Megatron-LM's ``--load``) at any TP/PP.

Written in one process without a process group or a model: each tensor is stored by its global shape (layers
stacked along a leading axis, ``linear_qkv`` grouped by query group, the SwiGLU ``linear_fc1`` as ``[gate; up]``,
as ``sharded_state_dict`` declares them) in the chunks the target TP ranks own - vocabulary rows, q/k/v and fc1
rows, proj/fc2 columns, one chunk per layer (megatron-core stores layers one chunk each whatever the PP size, so
PP shows only in ``args``) - with ``torch.distributed.checkpoint`` (``no_dist``: one writer), plus megatron-core's
``metadata.json``, the linear layers' (empty) ``_extra_state`` objects and a ``common.pt`` holding Megatron-LM's
``args`` (model hyper-parameters, parallel sizes, padded vocabulary), ``iteration`` and ``checkpoint_version``.
The folder is a Megatron-LM checkpoint root: ``iter_XXXXXXX`` (``release`` for iteration 0) and
``latest_checkpointed_iteration.txt``. The vocabulary is padded with zero rows as Megatron-LM pads it
(``--make-vocab-size-divisible-by`` x TP); ``--loader mcore --true-vocab-size`` drops them again.

Layer names are the local spec's sharded names (``self_attention.linear_qkv.layer_norm_weight`` for the input
norm), which megatron-core's local and Transformer Engine specs both map to. Tied embeddings are written untied
(``untie_embeddings_and_output_weights``): our LM head is its own unit.
"""

from __future__ import annotations

import argparse
import io
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_spindle.checkpointing.names import from_te_names
from tools.checkpoint.common import ConversionError, Metadata, UnitMessage, parse_dtype, staged_output
from tools.checkpoint.hf_mapping import EPS_OURS, ROPE_BASE_OURS

# our local-spec name (after "<owner>.layers.<i>.") -> megatron-core sharded key (after "decoder.layers.")
_LAYER_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias": "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}
# how TP splits each layer tensor: axis of the (unstacked) tensor, "swiglu" for [gate; up] rows, None: replicated
_TP_AXIS = {"self_attention.linear_qkv.layer_norm_weight": None, "mlp.linear_fc1.layer_norm_weight": None,
            "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
            "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": "swiglu", "mlp.linear_fc2.weight": 1}
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
CHECKPOINT_VERSION = 3.0


def _has_option(parser, flag: str) -> bool:
    return any(flag in action.option_strings for action in parser._actions)


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="megatron-core saver")
    group.add_argument("--target-tensor-parallel-size", type=int, default=1,
                       help="TP size whose layout the checkpoint is written in (any TP loads it).")
    group.add_argument("--target-pipeline-parallel-size", type=int, default=1,
                       help="PP size whose layout the checkpoint is written in (layers split evenly).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this x TP, as Megatron-LM does (1: no padding).")
    group.add_argument("--saver-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                       help="dtype of the saved tensors (Megatron-LM casts them to its params dtype on load).")
    group.add_argument("--saver-iteration", type=int, default=None,
                       help="Iteration to record (default: the source's; 0 is written as Megatron-LM's 'release').")
    if not _has_option(parser, "--mcore-module"):  # the mcore loader has it too
        group.add_argument("--mcore-module", default=None,
                           help="Workload module to write (default: the workload's only llm module).")


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _validate(spec, tp: int, pp: int, divisible_by: int) -> int:
    for flag, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-parallel-size", pp),
                        ("--make-vocab-size-divisible-by", divisible_by)):
        if value <= 0:
            raise ConversionError(f"{flag} must be positive, got {value}")
    where = f"module '{spec.name}'"
    for what, n in (("num_heads", spec.num_heads), ("num_query_groups", spec.query_groups),
                    ("ffn_hidden_size", spec.ffn_hidden_size)):
        if n % tp:
            raise ConversionError(f"{where}: {what} {n} is not divisible by --target-tensor-parallel-size {tp}")
    if spec.num_layers % pp:
        raise ConversionError(f"{where}: {spec.num_layers} layers do not split evenly over "
                              f"--target-pipeline-parallel-size {pp}")
    if spec.lm_vocab != spec.frontend.vocab_size:
        raise ConversionError(f"{where}: input vocabulary {spec.frontend.vocab_size} and output vocabulary "
                              f"{spec.lm_vocab} differ; a megatron-core GPT has one vocabulary")
    return padded_vocab(spec.lm_vocab, divisible_by, tp)


def megatron_args(spec, tp: int, pp: int, divisible_by: int, padded: int, dtype: torch.dtype,
                  iteration: int) -> argparse.Namespace:
    """The Megatron-LM ``args`` stored in ``common.pt`` (what ``--use-checkpoint-args`` and the checkpoint checks
    of ``load_checkpoint`` read)."""
    rope = ROPE_BASE_OURS if spec.rotary_base is None else float(spec.rotary_base)
    eps = EPS_OURS if spec.norm_epsilon is None else float(spec.norm_epsilon)
    return argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, group_query_attention=spec.query_groups != spec.num_heads,
        num_query_groups=spec.query_groups, kv_channels=spec.hidden_size // spec.num_heads,
        position_embedding_type="rope", add_position_embedding=False, rotary_percent=1.0,
        rotary_base=int(rope) if float(rope).is_integer() else rope,
        use_rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=8.0 if spec.rope_scaling_factor is None else float(spec.rope_scaling_factor),
        normalization="RMSNorm", norm_epsilon=eps, swiglu=spec.act == "silu", add_bias_linear=False,
        add_qkv_bias=bool(spec.qkv_bias), untie_embeddings_and_output_weights=True,
        vocab_size=spec.lm_vocab, padded_vocab_size=padded, make_vocab_size_divisible_by=divisible_by,
        max_position_embeddings=4096, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, ckpt_format="torch_dist",
        iteration=iteration, apply_query_key_layer_scaling=False)


# ------------------------------------------------------------------------------------------ chunks


class _Chunk:
    """One stored piece of a global tensor: ``offsets`` / ``sizes`` in the global shape, ``read()`` its values."""

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], read: Callable[[], torch.Tensor]):
        self.offsets, self.sizes, self.read = offsets, sizes, read


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = n // parts
    return [(i * step, step) for i in range(parts)]


def _vocab_chunks(read_rows: Callable[[int, int], torch.Tensor], vocab: int, padded: int, h: int,
                  tp: int) -> list[_Chunk]:
    """Vocabulary-parallel rows of each TP rank; rows past the true vocabulary are zero (padding)."""
    chunks = []
    for start, size in _split(padded, tp):
        def read(start=start, size=size):
            real = max(0, min(vocab, start + size) - start)
            rows = read_rows(start, real) if real else None
            pad = torch.zeros(size - real, h, dtype=rows.dtype if rows is not None else torch.float32)
            return pad if rows is None else torch.cat([rows, pad]) if size > real else rows
        chunks.append(_Chunk((start, 0), (size, h), read))
    return chunks


def _layer_chunks(read: Callable[[], torch.Tensor], layer: int, shape: tuple[int, ...], axis, tp: int) -> list[_Chunk]:
    """Chunks of one layer's tensor in the stacked ``(num_layers, ...)`` global tensor."""
    def piece(sl):
        return lambda: read()[sl].unsqueeze(0).contiguous()

    if axis is None:
        return [_Chunk((layer,) + (0,) * len(shape), (1, *shape), piece((slice(None),)))]
    chunks = []
    if axis == "swiglu":  # TP rank r holds gate rows [r f/tp, (r+1) f/tp) and the same rows of up
        f = shape[0] // 2
        for start, size in _split(f, tp):
            for base in (0, f):
                sl = (slice(base + start, base + start + size),)
                chunks.append(_Chunk((layer, base + start) + (0,) * (len(shape) - 1), (1, size, *shape[1:]),
                                     piece(sl)))
        return chunks
    for start, size in _split(shape[axis], tp):
        sl = tuple(slice(start, start + size) if d == axis else slice(None) for d in range(len(shape)))
        offsets = tuple(start if d == axis else 0 for d in range(len(shape)))
        sizes = tuple(size if d == axis else n for d, n in enumerate(shape))
        chunks.append(_Chunk((layer, *offsets), (1, *sizes), piece(sl)))
    return chunks


def _planner(tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[_Chunk]]], objects: dict[str, bytes]):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    lookup: dict[tuple[str, tuple[int, ...]], _Chunk] = {}

    class ChunkSavePlanner(DefaultSavePlanner):
        """Writes the listed chunks (read lazily, one at a time) and byte objects of one process."""

        def create_local_plan(self):
            items = []
            for fqn, (size, dtype, chunks) in tensors.items():
                for c in chunks:
                    lookup[(fqn, c.offsets)] = c
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.offsets),
                                                                               torch.Size(c.sizes)),
                                                    properties=TensorProperties(dtype=dtype), size=torch.Size(size))))
            for fqn in objects:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(objects[fqn])
            c = lookup[(fqn, tuple(write_item.index.offset))]
            t = c.read()
            if tuple(t.shape) != c.sizes:
                raise ConversionError(f"{fqn}: chunk at {c.offsets} has shape {tuple(t.shape)}, expected {c.sizes}")
            return t.to(tensors[fqn][1]).contiguous()

    return ChunkSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


# ------------------------------------------------------------------------------------------ saver


def _spill(tmp: Path, msg: UnitMessage, prefix: str) -> Path:
    path = tmp / f"{len(list(tmp.iterdir())):06d}.safetensors"
    tensors = {k[len(prefix):]: v.contiguous() for k, v in from_te_names(msg.tensors).items()}
    save_file(tensors, str(path))
    return path


def _reader(path: Path, name: str) -> Callable[[], torch.Tensor]:
    def read():
        with safe_open(path, "pt") as f:
            return f.get_tensor(name)
    return read


def _rows_reader(path: Path, name: str) -> Callable[[int, int], torch.Tensor]:
    def read(start: int, count: int):
        with safe_open(path, "pt") as f:
            return f.get_slice(name)[start:start + count]
    return read


def save_checkpoint(messages: Iterator, args, workload) -> Path:
    from tools.checkpoint.loader_mcore import _llm_module

    spec = _llm_module(workload, args.mcore_module)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    padded = _validate(spec, tp, pp, args.make_vocab_size_divisible_by)
    dtype = parse_dtype(args.saver_dtype)
    owner = workload.param_owner(spec.name, next(t.name for t in workload.tasks if spec.name in t.tokens))
    log = getattr(args, "log", print)
    L, V = spec.num_layers, spec.lm_vocab
    meta = Metadata(source="?")
    with staged_output(args.save_dir) as tmp:
        spill = tmp / ".spill"
        spill.mkdir()
        files: dict[str, Path] = {}
        skipped: list[str] = []
        for msg in messages:
            if isinstance(msg, Metadata):
                meta = msg
            elif isinstance(msg, UnitMessage):
                if msg.unit.split(".")[0] != owner:
                    skipped.append(msg.unit)
                    continue
                files[msg.unit[len(owner) + 1:]] = _spill(spill, msg, msg.unit + ".")
        missing = [p for p in ["frontend", *(f"layers.{i}" for i in range(L)), "lm_head"] if p not in files]
        if missing:
            raise ConversionError(f"the loader produced no '{owner}.{missing[0]}' unit ({len(missing)} of the llm "
                                  f"module's units missing): nothing to write")
        iteration = meta.iteration if args.saver_iteration is None else args.saver_iteration
        folder = tmp / ("release" if iteration == 0 else f"iter_{iteration:07d}")
        tensors, objects = _layout(files, spec, tp, pp, padded, dtype)
        chunks = sum(len(c) for _, _, c in tensors.values())
        log(f"writing {folder.name}: {len(tensors)} tensors in {chunks} chunks (TP={tp} x PP={pp} layout)")
        _write_torch_dist(folder, tensors, objects)
        common = {"args": megatron_args(spec, tp, pp, args.make_vocab_size_divisible_by, padded, dtype, iteration),
                  "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
        torch.save(common, folder / "common.pt")
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                          "sharded_backend_version": 1, "common_backend": "torch",
                                                          "common_backend_version": 1}))
        (tmp / "latest_checkpointed_iteration.txt").write_text("release" if iteration == 0 else str(iteration))
        for p in spill.iterdir():
            p.unlink()
        spill.rmdir()
        if skipped:
            log(f"not written (not the llm module '{spec.name}'): {skipped[:8]}{' ...' if len(skipped) > 8 else ''}")
        log(f"wrote {folder.name}: {len(tensors)} tensors in the TP={tp} x PP={pp} layout, vocabulary {V} padded "
            f"to {padded} (from {meta.source})")
    return Path(args.save_dir)


def _layout(files: dict[str, Path], spec, tp: int, pp: int, padded: int, dtype: torch.dtype):
    """Global shape, dtype and chunks of every tensor; the byte objects."""
    h, L, V = spec.hidden_size, spec.num_layers, spec.lm_vocab
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[_Chunk]]] = {}
    tensors["embedding.word_embeddings.weight"] = ((padded, h), dtype, _vocab_chunks(
        _rows_reader(files["frontend"], "word_embeddings.weight"), V, padded, h, tp))
    with safe_open(files["layers.0"], "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    for ours, key in _LAYER_KEYS.items():
        if ours not in shapes:
            continue  # q/k/v bias only with qkv_bias
        chunks = [c for i in range(L) for c in _layer_chunks(_reader(files[f"layers.{i}"], ours), i, shapes[ours],
                                                              _TP_AXIS[key], tp)]
        tensors[f"decoder.layers.{key}"] = ((L, *shapes[ours]), dtype, chunks)
    extra = {n for n in shapes if n not in _LAYER_KEYS}
    if extra:
        raise ConversionError(f"llm layer tensors {sorted(extra)} have no megatron-core GPT counterpart")
    tensors["decoder.final_layernorm.weight"] = ((h,), dtype, [_Chunk((0,), (h,), _reader(files["lm_head"],
                                                                                       "final_norm.weight"))])
    tensors["output_layer.weight"] = ((padded, h), dtype, _vocab_chunks(
        _rows_reader(files["lm_head"], "output_layer.weight"), V, padded, h, tp))
    payload = io.BytesIO()
    torch.save([None], payload)  # what megatron-core's linear layers store as _extra_state
    objects = {f"decoder.layers.{m}._extra_state/shard_{i}_{L}": payload.getvalue()
               for i in range(L) for m in _EXTRA_STATE}
    return tensors, objects


def _write_torch_dist(folder: Path, tensors: dict, objects: dict[str, bytes]) -> None:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    folder.mkdir(parents=True)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": what we want
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save({}, storage_writer=FileSystemWriter(str(folder), thread_count=1),
                 planner=_planner(tensors, objects), no_dist=True)
