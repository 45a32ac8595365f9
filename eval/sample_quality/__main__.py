"""``python -m eval.sample_quality``: the command line of :mod:`eval.sample_quality` (see its docstring)."""

from eval.sample_quality import cli

if __name__ == "__main__":
    raise SystemExit(cli())
