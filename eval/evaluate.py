"""Test-split metrics of a trained VQ-VAE: the ``softvq-evaluate`` command (:mod:`softvq.cli.evaluate`) run from a
clone, e.g. ``python -m eval.evaluate --help``."""

import sys

from softvq.cli.evaluate import cli

if __name__ == "__main__":
    sys.exit(cli())
