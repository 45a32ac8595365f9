"""The one command-line convention of the ``softvq-*`` commands (docs/training.md, "Commands and config files").

Every command is a jsonargparse parser built from typed constructors and their docstrings, the convention of the
Lightning ecosystem: ``--config FILE`` (YAML or JSON; flags after it win), ``--print_config`` (the settings as YAML,
a file to start from), and sections with the same names for the same things: ``--data.*`` (where the images are and
how they are read), ``--model.*`` (what is built and how it is optimised), ``--trainer.*`` (how Lightning runs it).
A command saves the configuration it resolved beside its outputs.

The spellings of the release before this convention (``--data-root``, ``--no-progress-bar``, ...) keep working for
one release: :meth:`Legacy.translate` rewrites them to the new flags with a ``FutureWarning`` that names the new one.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace


def command_parser(prog: str, description: str, epilog: str | None = None) -> ArgumentParser:
    """A ``softvq-*`` command's parser with ``--config`` (and the ``--print_config`` that jsonargparse adds with it)."""
    p = ArgumentParser(prog=prog, description=description, epilog=epilog)
    p.add_argument("--config", action=ActionConfigFile, help="a YAML/JSON file of these settings (flags after it win)")
    return p


class Legacy:
    """The old spellings of one command: ``renames`` maps an old option that takes a value to its new name
    (``"--data-root": "--data.data_root"``); ``switches`` maps an old on/off flag to the new option and the value it
    stood for (``"--no-progress-bar": ("--trainer.progress_bar", "false")``; ``None``: the new one is a flag too)."""

    def __init__(self, prog: str, renames: Mapping[str, str] | None = None,
                 switches: Mapping[str, tuple[str, str | None]] | None = None) -> None:
        self.prog = prog
        self.renames = dict(renames or {})
        self.switches = dict(switches or {})

    def translate(self, argv: Sequence[str]) -> list[str]:
        """``argv`` with every old spelling replaced by the new one (``--old=value`` too), each warned about once.
        The value after a renamed option is copied as it is (it may start with ``-``); nothing after ``--`` is
        rewritten."""
        out: list[str] = []
        warned: set[str] = set()
        args = list(argv)
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--":
                out.extend(args[i:])
                break
            name, eq, value = token.partition("=")
            if name in self.renames:
                new = self.renames[name]
                self._warn(name, new, warned)
                if eq:
                    out.append(f"{new}={value}")
                else:
                    out.append(new)
                    if i + 1 < len(args):  # the value, copied as it is (it may start with "-": a negative number)
                        out.append(args[i + 1])
                        i += 1
            elif token in self.switches:
                new, flag_value = self.switches[token]
                self._warn(token, new if flag_value is None else f"{new} {flag_value}", warned)
                out.extend([new] if flag_value is None else [new, flag_value])
            else:
                out.append(token)
            i += 1
        return out

    def _warn(self, old: str, new: str, warned: set[str]) -> None:
        if old in warned:
            return
        warned.add(old)
        warnings.warn(f"{self.prog}: {old} is deprecated and will be removed in the next release; use {new}",
                      FutureWarning, stacklevel=4)


def parse(parser: ArgumentParser, legacy: Legacy, argv: Sequence[str] | None) -> Namespace:
    """``argv`` (``sys.argv[1:]`` when ``None``) parsed after :meth:`Legacy.translate`; exit 2 on a bad flag."""
    return parser.parse_args(legacy.translate(sys.argv[1:] if argv is None else argv))


def resolved(cfg: Namespace, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed configuration as JSON values, without ``--config``'s bookkeeping and the top-level keys in
    ``exclude`` (what an invocation does, e.g. ``resume``, rather than a setting): what a command saves, and a file
    that ``--config`` reads back to the same settings."""
    config = cfg.clone().as_dict()
    for key in ("config", "__path__", *exclude):
        config.pop(key, None)
    return json.loads(json.dumps(config, default=str))
