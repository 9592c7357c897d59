"""Mixed precision: --bf16 / --fp16 and fp16's loss scaling (Megatron's flags and defaults).

--fp16 runs the operators in float16 (masters, gradient buffers and AdamW stay fp32) with megatron-core's
loss scaler (megatron.core.optimizer.grad_scaler): dynamic by default (--initial-loss-scale, halved by
--hysteresis overflowing steps in a row down to --min-loss-scale, doubled after --loss-scale-window clean
ones), constant with --loss-scale. An overflowing step is skipped (runtime/clip.py). megatron-core's scalers
keep their state on CUDA, so --fp16, like --bf16, needs a GPU; on a CPU machine it stops with one line. The
scaler state is saved with each checkpoint (metadata "extra") and restored on resume unless the optimizer is
not (--no-load-optim, --finetune).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_spindle.flags import add_flags, config_from_args, flag


@dataclass(frozen=True)
class LossScaleConfig:
    loss_scale: float | None = field(default=None, metadata=flag(
        "Static loss scale for --fp16 (a power of 2); default: dynamic loss scaling."))
    initial_loss_scale: float = field(default=2.0 ** 32, metadata=flag("Initial dynamic loss scale (--fp16)."))
    min_loss_scale: float = field(default=1.0, metadata=flag("Lowest dynamic loss scale (--fp16)."))
    loss_scale_window: int = field(default=1000, metadata=flag(
        "Steps without overflow before the dynamic loss scale doubles (--fp16)."))
    hysteresis: int = field(default=2, metadata=flag(
        "Overflowing steps in a row before the dynamic loss scale halves (--fp16)."))


def add_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="Run the operators in float16 with loss scaling (GPU only; "
                   "masters and optimizer state stay fp32).")
    add_flags(g, LossScaleConfig)
    return parser


def check_precision_args(args: argparse.Namespace, cuda: bool) -> None:
    if args.fp16 and args.bf16:
        raise ValueError("give --fp16 or --bf16, not both")
    if args.fp16 and not cuda:
        raise ValueError("--fp16 needs a GPU: torch.cuda.is_available() is False on this machine, and "
                         "megatron-core's loss scaler keeps its state on CUDA (drop --fp16 to train in fp32 on CPU)")
    cfg = config_from_args(LossScaleConfig, args)
    if cfg.loss_scale is not None and not cfg.loss_scale > 0:
        raise ValueError(f"--loss-scale must be positive, got {cfg.loss_scale}")
    if not 0 < cfg.min_loss_scale <= cfg.initial_loss_scale:
        raise ValueError(f"--min-loss-scale must lie in (0, --initial-loss-scale={cfg.initial_loss_scale}], "
                         f"got {cfg.min_loss_scale}")
    if cfg.loss_scale_window <= 0 or cfg.hysteresis <= 0:
        raise ValueError("--loss-scale-window and --hysteresis must be positive")
    if not args.clip_grad >= 0:
        raise ValueError(f"--clip-grad must be >= 0 (0: no clipping), got {args.clip_grad}")


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def make_grad_scaler(args: argparse.Namespace) -> Any:
    """megatron-core's scaler for --fp16 (None otherwise); needs CUDA."""
    if not args.fp16:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    cfg = config_from_args(LossScaleConfig, args)
    if cfg.loss_scale is not None:
        return ConstantGradScaler(cfg.loss_scale)
    return DynamicGradScaler(initial_scale=cfg.initial_loss_scale, min_scale=cfg.min_loss_scale, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=cfg.loss_scale_window, hysteresis=cfg.hysteresis)


def scaler_state(scaler) -> dict[str, Any] | None:
    """JSON-able state of a dynamic scaler (for the checkpoint's metadata)."""
    if scaler is None or not hasattr(scaler, "_growth_tracker"):
        return None
    st = scaler.state_dict()
    return {"scale": float(st["scale"]), "growth_tracker": int(st["growth_tracker"]),
            "hysteresis_tracker": int(st["hysteresis_tracker"])}


def load_scaler_state(scaler, state: dict[str, Any] | None) -> None:
    if scaler is None or not state or not hasattr(scaler, "_growth_tracker"):
        return
    scaler.load_state_dict({"scale": torch.tensor([float(state["scale"])]), "growth_tracker": state["growth_tracker"],
                            "hysteresis_tracker": state["hysteresis_tracker"]})
