"""``python -m eval.long_run``: the command line of :mod:`eval.long_run` (see its docstring)."""

from eval.long_run import cli

if __name__ == "__main__":
    raise SystemExit(cli())
