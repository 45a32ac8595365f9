"""Train VQ-VAEs on CIFAR-10 with DDCL and/or hard VQ, side by side: the ``softvq-train``
command (:mod:`softvq.cli.train`) run from a clone, e.g. ``python train_vqvae.py --help``."""

import sys

from softvq.cli.train import cli

if __name__ == "__main__":
    sys.exit(cli())
