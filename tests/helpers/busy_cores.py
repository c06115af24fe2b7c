"""`python -m tests.helpers.busy_cores BUSY fit ...`: the CLI in a process where the measurement of the cores that
other programs keep busy (`src.run.threads.busy_cores`) reports BUSY (a float), whatever the machine's load.

The thread choice of a run started this way is therefore known in advance, so a test can make a resumed run's
fresh choice differ from its first start's on purpose. Only the measurement is replaced: the CLI, the Trainer and
the training run as usual.
"""

import sys

from src.run import threads


def main() -> int:
    """Replace the measurement with argv[1], then run the CLI on the remaining arguments."""
    busy = float(sys.argv.pop(1))
    threads.busy_cores = lambda: busy  # choose_threads looks the default measurement up when it is called
    from src.cli import run

    return run()


if __name__ == "__main__":
    sys.exit(main())
