"""``python -m eval.compare``: the command line of :mod:`eval.compare` (see its docstring)."""

import logging
import sys

from eval.compare import main
from softvq.cli.common import EXPECTED_ERRORS, run_command

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sys.exit(run_command(main, errors=(*EXPECTED_ERRORS, RuntimeError)))
