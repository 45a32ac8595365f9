"""``python -m eval.readout``: the command line of :mod:`eval.readout` (see its docstring)."""

import sys

from eval.readout import main
from softvq.cli.common import run_command

if __name__ == "__main__":
    sys.exit(run_command(main))
