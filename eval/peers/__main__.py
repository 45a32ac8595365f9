"""``python -m eval.peers``: the command line of :mod:`eval.peers` (see its docstring)."""

from eval.peers import cli

if __name__ == "__main__":
    raise SystemExit(cli())
