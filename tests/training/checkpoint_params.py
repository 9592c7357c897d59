"""What the training tests compare between two runs: a checkpoint and its parameters by full name."""

from megatron_spindle.checkpointing import load_checkpoint


def checkpoint_params(path) -> tuple:
    ck = load_checkpoint(path)
    return ck, {k: v for s in ck.units.values() for k, v in s.model.items()}
