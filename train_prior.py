"""Train an autoregressive code prior on a trained VQ-VAE's code grids: the ``softvq-prior``
command (:mod:`softvq.cli.prior`) run from a clone, e.g. ``python train_prior.py --help``."""

import sys

from softvq.cli.prior import cli

if __name__ == "__main__":
    sys.exit(cli())
