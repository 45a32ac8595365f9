"""``python -m eval.paradigm1``: the command line of :mod:`eval.paradigm1` (see its docstring)."""

import sys

from eval.paradigm1 import main
from softvq.cli.common import run_command

if __name__ == "__main__":
    sys.exit(run_command(main))
