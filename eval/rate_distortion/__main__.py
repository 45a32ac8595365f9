"""``python -m eval.rate_distortion``: the command line of :mod:`eval.rate_distortion` (see its docstring)."""

from eval.rate_distortion import cli

if __name__ == "__main__":
    raise SystemExit(cli())
