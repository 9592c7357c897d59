"""``pretrain_multitask.py`` whose planning (rank 0's autoplan) first sleeps ``PLAN_DELAY_S`` seconds: a plan that
takes longer to make than --distributed-timeout-minutes, as a large cluster's may (tests/training/test_faults.py),
and whose writing of the plan files (rank 0, before the first iteration) first sleeps ``WRITE_DELAY_S``, as a large
cluster's chart may. Importing it changes nothing; running it as the script patches both in its own process."""

import sys
import time
from pathlib import Path

PLAN_DELAY_S = 20.0
WRITE_DELAY_S = 3.0


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import megatron_spindle.autoplan as autoplan_module
    import pretrain_multitask

    autoplan = autoplan_module.autoplan

    def slow_autoplan(*args, **kwargs):
        time.sleep(PLAN_DELAY_S)
        return autoplan(*args, **kwargs)

    autoplan_module.autoplan = slow_autoplan
    import megatron_spindle.training.trainer as trainer

    write_plan_files = trainer.write_plan_files

    def slow_write_plan_files(*args, **kwargs):
        time.sleep(WRITE_DELAY_S)
        return write_plan_files(*args, **kwargs)

    trainer.write_plan_files = slow_write_plan_files
    sys.argv[0] = pretrain_multitask.__file__  # its name in the error lines
    return pretrain_multitask.main()


if __name__ == "__main__":
    sys.exit(main())
