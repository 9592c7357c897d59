"""``pretrain_multitask.py`` whose planning (rank 0's autoplan) first sleeps ``PLAN_DELAY_S`` seconds: a plan that
takes longer to make than --distributed-timeout-minutes, as a large cluster's may (tests/training/test_faults.py).
Importing it changes nothing; running it as the script patches autoplan in its own process."""

import sys
import time
from pathlib import Path

PLAN_DELAY_S = 20.0


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import megatron_spindle.autoplan as autoplan_module
    import pretrain_multitask

    autoplan = autoplan_module.autoplan

    def slow_autoplan(*args, **kwargs):
        time.sleep(PLAN_DELAY_S)
        return autoplan(*args, **kwargs)

    autoplan_module.autoplan = slow_autoplan
    sys.argv[0] = pretrain_multitask.__file__  # its name in the error lines
    return pretrain_multitask.main()


if __name__ == "__main__":
    sys.exit(main())
