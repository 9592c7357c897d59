"""Training driver (pretrain_multitask.py): argument groups, LR schedule, Megatron-format logging, engine
adapters for checkpoints, data and timing."""
