"""Draw images from a trained code prior and its VQ-VAE: the ``softvq-sample``
command (:mod:`softvq.cli.sample`) run from a clone, e.g. ``python sample.py --help``."""

import sys

from softvq.cli.sample import cli

if __name__ == "__main__":
    sys.exit(cli())
