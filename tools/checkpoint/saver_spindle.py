"""Saver plugin ``spindle``: parameter units -> a megatron-spindle checkpoint (megatron_spindle/checkpointing).

Streaming: each incoming unit is spilled to its own safetensors file in a temporary folder beside ``--save-dir``
(nothing is kept in memory); at the end ``checkpointing.save_checkpoint`` writes the real checkpoint from lazy
per-unit views of those files (one unit in memory at a time), and the folder is renamed to ``--save-dir``.
Units of the workload the loader did not produce (projectors, unmapped towers, heads) get the training run's
deterministic initialisation (``--no-fill-missing``: fail instead), so ``pretrain_multitask.py --load`` finds
every unit it expects; the data position is the start of every task's data and there is no optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_spindle.checkpointing.names import to_te_names
from tools.checkpoint.common import ConversionError, Metadata, UnitMessage, parse_dtype, staged_output
from tools.checkpoint.layout import expected_units


def add_arguments(parser) -> None:
    group = parser.add_argument_group(title="megatron-spindle saver")
    group.add_argument("--saver-dtype", default="fp32", choices=["fp32", "bf16", "fp16", "source"],
                       help="dtype of the saved tensors (training keeps fp32 masters).")
    group.add_argument("--iteration", type=int, default=0, help="Iteration recorded in the checkpoint.")
    group.add_argument("--no-fill-missing", action="store_true",
                       help="Fail when the loader does not produce every unit of the workload (default: fill "
                            "missing units with the deterministic initialisation of the training run).")
    group.add_argument("--layer-names", default="auto", choices=["auto", "local", "te"],
                       help="Tensor names of the layers' pre-norms in the files: megatron-core local spec (what "
                            "the runtime writes) or Transformer Engine spec (fused pre-norms); the runtime and the "
                            "loaders read both. auto: te when Transformer Engine can be used here.")


class SpilledTensors(Mapping):
    """Read-only mapping name -> tensor backed by one safetensors file; every access reads from disk."""

    def __init__(self, path: Path):
        self.path = path
        with safe_open(path, "pt") as f:
            self._keys = list(f.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self.path, "pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _use_te_names(choice: str) -> bool:
    if choice == "auto":
        from megatron_spindle.compat.cpu import te_available

        return te_available()
    return choice == "te"


def _initial_unit(unit: str, shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    from megatron_spindle.models.config import ModelConfig
    from megatron_spindle.models.state import init_full_tensor

    std = ModelConfig().init_std
    return {name: init_full_tensor(name, shape, std, seed) for name, shape in shapes.items()}


def start_of_data(workload, iteration: int) -> dict:
    """A data position at the start of every task's data (what a fresh run uses), in the sampler's format
    (data/sampler.py) without dataset sizes or seed, so ``pretrain_multitask.py --load`` accepts it for any
    dataset of the workload's tasks."""
    return {"iteration": iteration, "tasks": {t.name: {"epoch": 0, "offset": 0} for t in workload.tasks}}


def save_checkpoint(messages: Iterator, args, workload) -> Path:
    from megatron_spindle.checkpointing import UnitState
    from megatron_spindle.checkpointing import save_checkpoint as write_checkpoint

    dtype = parse_dtype(args.saver_dtype)
    te_names = _use_te_names(args.layer_names)
    expected = expected_units(workload)
    log = getattr(args, "log", print)
    meta = Metadata(source="?")
    with staged_output(args.save_dir) as tmp:
        spill = tmp / "spill"
        spill.mkdir()
        files: dict[str, Path] = {}
        for msg in messages:
            if isinstance(msg, Metadata):
                meta = msg
            elif isinstance(msg, UnitMessage):
                tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in msg.tensors.items()}
                files[msg.unit] = spill / f"{len(files):06d}.safetensors"
                save_file(to_te_names(tensors) if te_names else tensors, str(files[msg.unit]))
        missing = [u for u in expected if u not in files]
        if missing and args.no_fill_missing:
            raise ConversionError(f"the loader produced no tensors for unit(s) {missing[:8]} (--no-fill-missing)")
        for unit in missing:
            tensors = _initial_unit(unit, expected[unit], args.init_seed)
            files[unit] = spill / f"{len(files):06d}.safetensors"
            save_file(to_te_names(tensors) if te_names else tensors, str(files[unit]))
        if missing:
            log(f"initialised {len(missing)} unit(s) the source does not have: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}")
        units = {unit: UnitState(SpilledTensors(path), {}) for unit, path in files.items()}
        out = tmp / "checkpoint"
        write_checkpoint(out, args.iteration, units, workload_name=workload.name,
                         workload_digest=workload.model_digest(), plan=meta.plan,
                         data_position=start_of_data(workload, args.iteration),
                         extra={"converted_from": meta.source, "converter": "tools/checkpoint/convert.py",
                                "source_iteration": meta.iteration})
        for p in out.iterdir():
            p.rename(tmp / p.name)
        out.rmdir()
        for p in files.values():
            p.unlink()
        spill.rmdir()
    return Path(args.save_dir)
