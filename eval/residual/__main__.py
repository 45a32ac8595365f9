"""``python -m eval.residual``: the command line of :mod:`eval.residual` (see its docstring)."""

from eval.residual import cli

if __name__ == "__main__":
    raise SystemExit(cli())
