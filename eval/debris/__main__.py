"""``python -m eval.debris``: the command line of :mod:`eval.debris` (see its docstring)."""

from eval.debris import main

if __name__ == "__main__":
    main()
