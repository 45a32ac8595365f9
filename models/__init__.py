"""The VQ-VAE models, for code written against a clone: the source is :mod:`softvq.models` (installed with
``pip install "softvq[train]"``); import from there in new code."""

from softvq.models import *  # noqa: F403 - this package is that one under its repository name
from softvq.models import __all__  # noqa: F401
