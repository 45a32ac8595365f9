"""The one command-line convention of the ``softvq-*`` commands (docs/training.md, "Commands and config files").

Every command is a jsonargparse parser built from typed constructors and their docstrings, the convention of the
Lightning ecosystem: ``--config FILE`` (YAML or JSON; flags after it win), ``--print_config`` (the settings as YAML,
a file to start from), and sections with the same names for the same things: ``--data.*`` (where the images are and
how they are read), ``--model.*`` (what is built and how it is optimised), ``--trainer.*`` (how Lightning runs it).
A command saves the configuration it resolved beside its outputs.

:func:`parse` is the one place a command's flags and config files are read. What it refuses, it refuses with one
``error:`` line on stderr and status 2 (:func:`refuse`) that names the flag or key and what is accepted there (and at
most two lines more), before jsonargparse sees the input:

- a flag or config key that does not exist: the close matches and the names its section accepts;
- a former name (:class:`FormerFlags`: a command's flags before the shared convention, such as ``--data-root``,
  :data:`softvq._compat.FORMER_FLAGS`; a quantizer's options before they became settings classes,
  :data:`softvq._compat.FORMER_OPTIONS`): the name that replaced it, never a translation. Only user input is refused;
  a run's recorded ``config.json`` and a checkpoint's hyperparameters are upgraded when a run resumes
  (:func:`softvq._compat.upgrade_settings`), never parsed here;
- contradictory settings of one part (an option whose value is a settings class, or one of several:
  ``prototype_update`` takes an ``Ema`` or a ``Gradient``): fields of two classes, or a whole value (``--ddcl.restart
  null``, ``--ddcl.target_entropy 1.0``) and fields of the part both on the command line, or fields that would replace
  a whole value a config file gave. jsonargparse would keep one of them and drop the other without a word;
- a value of the wrong type: jsonargparse's error, shortened to the flag, what it accepts and the value given.

A part's field given by a flag reaches jsonargparse as a one-key mapping of the part, which it merges with the fields
given before (:meth:`softvq.cli._input._Checker.check`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from softvq.cli._input import CONFIG_EXTRA, FormerFlags, UsageError, _Checker, _Schema


def refuse(message: str) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with status 2, as argparse does for a bad flag (a script that
    calls a command's ``main`` or ``parse`` in-process gets ``SystemExit(2)``, as before)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def command_parser(prog: str, description: str, epilog: str | None = None) -> ArgumentParser:
    """A ``softvq-*`` command's parser with ``--config`` (and the ``--print_config`` that jsonargparse adds with it).
    It raises on a bad flag instead of printing its usage (:func:`parse` words the error) and takes no abbreviated
    flags (``--epoch`` for ``--epochs``: a misspelling is named, not guessed; jsonargparse 5 drops them too);
    ``--help`` and ``--print_config`` print and exit as before."""
    p = ArgumentParser(prog=prog, description=description, epilog=epilog, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML/JSON file of these settings (flags after it win)")
    return p


def parse(parser: ArgumentParser, argv: Sequence[str] | None, sections: Sequence[str] = ()) -> Namespace:
    """``argv`` (``sys.argv[1:]`` when ``None``) parsed by ``parser``, its config files included. A former flag of the
    command (:meth:`FormerFlags.of` its ``prog``, with the quantizer ``sections`` it has) is refused.

    Raises:
        SystemExit: status 2 (``--help`` and ``--print_config``: 0), after printing ``error:`` and one line naming
            the flag or key and what it accepts (:func:`refuse`): an unknown or former flag or config key,
            contradictory fields of a part, or a value of the wrong type (module docstring).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    schema = _Schema(parser)
    given = args[:args.index("--")] if "--" in args else args
    try:
        if not any(token in ("-h", "--help") or token.endswith(".help") for token in given):  # help, as it was
            args = _Checker(schema, FormerFlags.of(parser.prog, sections), parser.prog).check(args)
        return parser.parse_args(args)
    except UsageError as err:
        refuse(str(err))
    except argparse.ArgumentError as err:  # jsonargparse's, with exit_on_error=False
        refuse(schema.shorten(str(err)))


def resolved(cfg: Namespace, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed configuration as JSON values, without ``--config``'s bookkeeping and the top-level keys in
    ``exclude`` (what an invocation does, e.g. ``resume``, rather than a setting): what a command saves, and a file
    that ``--config`` reads back to the same settings."""
    config = cfg.clone().as_dict()
    for key in (*CONFIG_EXTRA, *exclude):
        config.pop(key, None)
    return json.loads(json.dumps(config, default=str))
