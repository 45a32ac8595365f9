"""``python -m eval.robustness``: the command line of :mod:`eval.robustness` (see its docstring)."""

from eval.robustness import cli

if __name__ == "__main__":
    raise SystemExit(cli())
