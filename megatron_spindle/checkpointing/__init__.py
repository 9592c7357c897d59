"""Layout-independent checkpoints (model, AdamW state, RNG, iteration, data position, plan); see checkpoint.py."""

from megatron_spindle.checkpointing.checkpoint import (
                                                       CHECKPOINT_FORMAT,
                                                       LATEST_FILE,
                                                       METADATA_FILE,
                                                       CheckpointError,
                                                       LoadedCheckpoint,
                                                       UnitState,
                                                       check_shapes,
                                                       iteration_dir,
                                                       load_checkpoint,
                                                       read_latest,
                                                       read_metadata,
                                                       save_checkpoint,
                                                       unit_owners,
)
from megatron_spindle.checkpointing.rng import get_rng_state, set_rng_state

__all__ = ["CHECKPOINT_FORMAT", "LATEST_FILE", "METADATA_FILE", "CheckpointError", "LoadedCheckpoint", "UnitState", "check_shapes",
           "iteration_dir", "load_checkpoint", "read_latest", "read_metadata", "save_checkpoint", "unit_owners",
           "get_rng_state", "set_rng_state"]
