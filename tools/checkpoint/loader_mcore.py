"""Loader plugin ``mcore``: a megatron-core GPT checkpoint (``dist_checkpointing``, torch_dist format, saved at any
TP/PP layout) -> the LLM backbone of the workload (front end, layers, LM head), one unit at a time.

The torch_dist format stores every tensor by its global shape (layers stacked along a leading axis, the SwiGLU
``linear_fc1`` as ``[gate; up]`` and ``linear_qkv`` grouped by query group, whatever TP wrote it), so one layer is
read as a slice of the stored chunks with ``torch.distributed.checkpoint`` (no process group, no model, no
megatron-core import). ``--load-dir`` is a Megatron-LM checkpoint root (``latest_checkpointed_iteration.txt``), an
``iter_XXXXXXX`` folder, or any folder holding a ``.metadata`` file.

Supported: the llama-style GPT our ``llm`` modules are (RoPE, RMSNorm, SwiGLU, GQA, no linear biases but q/k/v
biases for a module declaring ``qkv_bias: true``), local or Transformer Engine layer specs, tied or untied output
layer. Anything else found (other biases, learned absolute positions) is reported as an inexact conversion.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from tools.checkpoint.common import ConversionError, Metadata, Note, UnitMessage

# megatron-core key suffix (per layer) -> our name; the first spelling is the Transformer Engine / torch_dist one
_LAYER_KEYS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
}
_EMBED = "embedding.word_embeddings.weight"
_QKV_BIAS = "self_attention.linear_qkv.bias"


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="megatron-core loader")
    group.add_argument("--mcore-module", default=None,
                       help="Workload module that receives the GPT (default: the workload's only llm module).")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="Drop the padded vocabulary rows beyond this size (megatron pads the vocabulary).")


def resolve_dir(load_dir: str | Path) -> tuple[Path, int]:
    """(folder with ``.metadata``, iteration) of a Megatron-LM checkpoint root or a torch_dist folder."""
    load_dir = Path(load_dir)
    if (load_dir / ".metadata").exists():
        m = re.search(r"iter_(\d+)", load_dir.name)
        return load_dir, int(m.group(1)) if m else 0
    latest = load_dir / "latest_checkpointed_iteration.txt"
    if latest.exists():
        text = latest.read_text().strip()
        folder = load_dir / ("release" if text == "release" else f"iter_{int(text):07d}")
        if (folder / ".metadata").exists():
            return folder, 0 if text == "release" else int(text)
    raise ConversionError(f"{load_dir}: not a megatron-core torch_dist checkpoint (no .metadata, no "
                          f"latest_checkpointed_iteration.txt pointing at one)")


def _planner(slices: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        """Reads ``sizes`` elements at ``offsets`` of each stored tensor into a plain tensor of that size."""

        def create_local_plan(self):
            items = []
            for fqn, (offsets, sizes) in slices.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return SlicePlanner()


class TorchDistReader:
    """Slices of the tensors of a torch_dist checkpoint folder."""

    def __init__(self, folder: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.folder = folder
        self.tensors = {k: v for k, v in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
                        if hasattr(v, "chunks") and v.chunks}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, wanted: dict[str, int | None], meta: bool) -> dict[str, torch.Tensor]:
        """``{key: layer index into the leading axis, or None for the whole tensor}`` -> tensors."""
        from torch.distributed.checkpoint import FileSystemReader, load

        out, slices = {}, {}
        for key, layer in wanted.items():
            shape = self.shape(key)
            size = shape if layer is None else (1, *shape[1:])
            out[key] = torch.empty(size, dtype=self.dtype(key), device="meta" if meta else "cpu")
            slices[key] = ((0,) * len(shape) if layer is None else (layer,) + (0,) * (len(shape) - 1), size)
        if not meta:
            load(out, storage_reader=FileSystemReader(str(self.folder)), planner=_planner(slices), no_dist=True)
        return {k: (v if wanted[k] is None else v[0]) for k, v in out.items()}


def _find_prefix(reader: TorchDistReader) -> str:
    for key in reader.tensors:
        if key.endswith(_EMBED) and not key.startswith("optimizer."):
            return key[: -len(_EMBED)]
    raise ConversionError(f"{reader.folder}: no '{_EMBED}' tensor: not a GPT checkpoint")


def _llm_module(workload, name: str | None):
    if name is not None:
        if name not in workload.modules or workload.modules[name].kind != "llm":
            raise ConversionError(f"--mcore-module '{name}' is not an llm module of workload '{workload.name}'")
        return workload.modules[name]
    llms = [m for m in workload.modules.values() if m.kind == "llm"]
    if len(llms) != 1:
        raise ConversionError(f"workload '{workload.name}' has {len(llms)} llm modules; pick one with --mcore-module")
    return llms[0]


def _layer_keys(reader: TorchDistReader, prefix: str, qkv_bias: bool = False) -> tuple[dict[str, str], list[str]]:
    """(mcore key -> our name, other per-layer keys) of the stacked ``decoder.layers.*`` tensors."""
    lp = prefix + "decoder.layers."
    keys = dict(_LAYER_KEYS, **({_QKV_BIAS: _QKV_BIAS} if qkv_bias else {}))
    mapped, other = {}, []
    for key in reader.tensors:
        if not key.startswith(lp):
            continue
        suffix = key[len(lp):]
        if suffix in keys:
            mapped[key] = keys[suffix]
        else:
            other.append(key)
    return mapped, other


def _trim_vocab(t: torch.Tensor, true_vocab: int | None) -> torch.Tensor:
    return t if true_vocab is None or t.shape[0] <= true_vocab else t[:true_vocab]


def load_checkpoint(args, workload, meta: bool = False) -> Iterator[Metadata | UnitMessage | Note]:
    folder, iteration = resolve_dir(args.load_dir)
    reader = TorchDistReader(folder)
    prefix = _find_prefix(reader)
    spec = _llm_module(workload, args.mcore_module)
    owner = workload.param_owner(spec.name, next(t.name for t in workload.tasks if spec.name in t.tokens))
    mapped, other = _layer_keys(reader, prefix, spec.qkv_bias)
    if not mapped:
        raise ConversionError(f"{folder}: no stacked 'decoder.layers.*' tensors (torch_dist format expected)")
    num_layers = reader.shape(next(iter(mapped)))[0]
    if num_layers != spec.num_layers:
        raise ConversionError(f"module '{spec.name}' has {spec.num_layers} layers but the checkpoint {num_layers}")
    yield Metadata(source=f"mcore:{folder}", iteration=iteration, info={"layers": num_layers})
    for key in other:
        yield Note(f"megatron-core tensor '{key}' has no counterpart in our llm layers (dropped)")
    for key in reader.tensors:
        if key.startswith(prefix + "embedding.") and key != prefix + _EMBED:
            yield Note(f"megatron-core tensor '{key}' (learned absolute positions?) has no counterpart (dropped)")
    embed = _trim_vocab(reader.read({prefix + _EMBED: None}, meta)[prefix + _EMBED], args.true_vocab_size)
    yield UnitMessage(f"{owner}.frontend", {f"{owner}.frontend.word_embeddings.weight": embed}, origin=str(folder))
    for i in range(num_layers):
        tensors = reader.read({k: i for k in mapped}, meta)
        unit = f"{owner}.layers.{i}"
        out = {f"{unit}.{mapped[k]}": v for k, v in tensors.items()}
        if spec.qkv_bias and f"{unit}.{_QKV_BIAS}" not in out:  # no biases in the checkpoint: zero ones are exact
            qkv = out[f"{unit}.self_attention.linear_qkv.weight"]
            out[f"{unit}.{_QKV_BIAS}"] = torch.zeros(qkv.shape[0], dtype=qkv.dtype, device=qkv.device)
        yield UnitMessage(unit, out, origin=str(folder))
    out_key = prefix + "output_layer.weight"
    output = reader.read({out_key: None}, meta)[out_key] if out_key in reader.tensors else embed
    norm_key = prefix + "decoder.final_layernorm.weight"
    norm = reader.read({norm_key: None}, meta)[norm_key]
    yield UnitMessage(f"{owner}.lm_head", {f"{owner}.lm_head.final_norm.weight": norm,
                                           f"{owner}.lm_head.output_layer.weight": _trim_vocab(output,
                                                                                               args.true_vocab_size)},
                      origin=str(folder))
