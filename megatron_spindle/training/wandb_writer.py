"""--wandb-project / --wandb-exp-name / --wandb-save-dir: the same scalars as TensorBoard, to Weights & Biases.

wandb is optional and never a dependency: ``check_wandb`` runs with the other flag checks, before anything is
written, and stops the run with one line when --wandb-project is given but ``import wandb`` fails. Only rank 0
logs (it gathers the scalars). The run's files go to --wandb-save-dir, else <save>/wandb (Megatron's default),
else wandb's own default.
"""

from __future__ import annotations

import argparse
import importlib
import os


def add_wandb_args(group) -> None:
    group.add_argument("--wandb-project", default=None, help="Log the TensorBoard scalars to this Weights & Biases "
                       "project too (needs the wandb package; it is not a dependency).")
    group.add_argument("--wandb-exp-name", default=None, help="Name of the wandb run (default: wandb's).")
    group.add_argument("--wandb-entity", default=None, help="The wandb team or user the run belongs to (default: "
                       "wandb's).")
    group.add_argument("--wandb-save-dir", default=None, help="Folder of the wandb run files (default: <save>/wandb).")


def _import_wandb():
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ValueError(f"--wandb-project needs the wandb package, which cannot be imported here ({e}); "
                         f"install it (pip install wandb) or drop --wandb-project") from None


def check_wandb(args: argparse.Namespace) -> None:
    """ValueError naming the flag when --wandb-project is given and wandb is not importable."""
    if args.wandb_project:
        _import_wandb()
    elif args.wandb_exp_name or args.wandb_save_dir or args.wandb_entity:
        raise ValueError("--wandb-exp-name / --wandb-save-dir / --wandb-entity need --wandb-project")


class WandbWriter:
    """``log(scalars, step)`` / ``close()``; a no-op without --wandb-project or off rank 0."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.run = None
        if not args.wandb_project or rank != 0:
            return
        wandb = _import_wandb()
        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        kwargs = {"project": args.wandb_project, "name": args.wandb_exp_name, "entity": args.wandb_entity,
                  "config": {k: v for k, v in vars(args).items()
                             if isinstance(v, (int, float, str, bool, list, type(None)))}}
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            kwargs["dir"] = save_dir
        self.run = wandb.init(**kwargs)

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self.run is not None and scalars:
            self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
