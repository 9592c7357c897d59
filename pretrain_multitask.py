#!/usr/bin/env python
"""Pretrain a multi-task multi-modal model with Spindle's wavefront-scheduled plans.

Plans the workload at start (or runs --spindle-plan), prints the plan and draws its Gantt chart next to the
checkpoints, then trains on torch.distributed (one rank per device; torchrun for several), logging per-task
losses, per-wave measured time and predicted vs measured iteration time, and saving checkpoints that resume
under any other plan or world size.

Example (2 CPU processes):
    torchrun --nproc-per-node 2 pretrain_multitask.py --workload tiny-clip --mock-data --train-iters 20 \\
        --spindle-planner wavefront --save ckpt --load ckpt
"""

import sys

from megatron_spindle.training.trainer import pretrain


def train_valid_test_datasets_provider(workload, args, data_paths):
    """One training dataset per task: tar shards (--data-path TASK=PATH, decoded with each module's tokenizer /
    image processor / log-mel: data/preprocess.py) or mock samples (--mock-data)."""
    from megatron_spindle.data.datasets import build_datasets
    from megatron_spindle.data.preprocess import preprocessing_from_args

    return build_datasets(workload, data_paths, args.mock_data, seed=args.seed, mock_size=args.mock_data_samples,
                          preprocessing=preprocessing_from_args(args, workload))


def add_entry_point_args(parser, extra_args_provider=None):
    """This entry point's argument groups beyond the trainer's: the data preprocessing flags (Megatron-LM's
    --tokenizer-type / --tokenizer-model, --image-processor, --audio-processor), then the caller's."""
    from megatron_spindle.data.preprocess import add_preprocessing_args

    add_preprocessing_args(parser)
    return (extra_args_provider(parser) or parser) if extra_args_provider is not None else parser


def engine_provider(plan, workload, rank, world_size, args, batch_fn):
    """The runtime engine for this rank's slices of the plan (the model_provider of Megatron-LM)."""
    from megatron_spindle.runtime.engine import EngineConfig, OptimizerConfig, RuntimeEngine
    from megatron_spindle.training.precision import make_grad_scaler, params_dtype

    config = EngineConfig(optimizer=OptimizerConfig(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                                    eps=args.adam_eps, weight_decay=args.weight_decay,
                                                    clip_grad=args.clip_grad, no_weight_decay_1d=True),
                          data_seed=args.seed, dtype=params_dtype(args), grad_scaler=make_grad_scaler(args),
                          init_std=args.init_method_std, init_seed=args.seed, dropout_seed=args.seed,
                          check_for_nan=args.check_for_nan_in_loss_and_grad, count_zeros=args.log_num_zeros_in_grad)
    return RuntimeEngine(plan, workload, rank, world_size, config, batch_fn=batch_fn)


def main(argv=None, extra_args_provider=None, history=None):
    return pretrain(train_valid_test_datasets_provider, engine_provider, argv=argv,
                    extra_args_provider=lambda parser: add_entry_point_args(parser, extra_args_provider),
                    description=__doc__.strip().splitlines()[0], history=history)


if __name__ == "__main__":
    sys.exit(main())
