"""``python -m eval.sample_quality``: the command line of :mod:`eval.sample_quality` (see its docstring)."""

import logging

from eval.sample_quality import cli

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    raise SystemExit(cli())
