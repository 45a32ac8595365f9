"""What a ``softvq-*`` command's parser accepts, and the check of its input against it before jsonargparse reads it
(:func:`softvq.cli.parsing.parse` calls :class:`_Checker`): unknown and former names, contradictory fields of one
part, and jsonargparse's own errors shortened to one line. The rules are :mod:`softvq.cli.parsing`'s docstring."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from softvq._compat import former_flags

CONFIG_EXTRA = ("config", "__path__")  # keys jsonargparse itself puts in a configuration


class FormerFlags:
    """The names one command's flags had before (docs/training.md, "Commands and config files"), refused with the
    name that replaced them. ``renames`` maps a former option to today's (``"--data-root": "--data.data_root"``);
    ``switches`` maps a former on/off flag to the option that replaced it and the value it stood for
    (``"--no-progress-bar": ("--trainer.progress_bar", "false")``; ``None``: the new one is a flag too). The commands'
    tables are :data:`softvq._compat.FORMER_FLAGS` (:meth:`of`)."""

    def __init__(self, renames: Mapping[str, str] | None = None,
                 switches: Mapping[str, tuple[str, str | None]] | None = None) -> None:
        self.renames = dict(renames or {})
        self.switches = dict(switches or {})

    @classmethod
    def of(cls, prog: str, sections: Sequence[str] = ()) -> FormerFlags:
        """Command ``prog``'s former flags, with the former option names of its quantizer ``sections``
        (:func:`softvq._compat.former_flags`)."""
        return cls(**former_flags(prog, tuple(sections)))

    def replacement(self, flag: str) -> str | None:
        """What replaced the former ``flag`` (``"--trainer.progress_bar false"``), or ``None`` if it is not one."""
        if flag in self.renames:
            return self.renames[flag]
        if flag in self.switches:
            new, value = self.switches[flag]
            return new if value is None else f"{new} {value}"
        return None

    def message(self, flag: str, where: str = "") -> str | None:
        """``"--data-root was renamed --data.data_root"``; for a config key (``where`` the file) the keys without
        dashes; ``None`` if ``flag`` is not a former name."""
        new = self.replacement(flag)
        if new is None:
            return None
        verb = "renamed" if flag in self.renames else "replaced by"
        if where:
            return f"{where}: {flag.removeprefix('--')} was {verb} {new.removeprefix('--')}"
        return f"{flag} was {verb} {new}"


class UsageError(Exception):
    """A bad flag, config key or value, refused before the command reads or writes anything. Its message is one line
    (two with a hint) that names the flag or key and what is accepted there; :func:`softvq.cli.parsing.parse` prints
    it (:func:`softvq.cli.parsing.refuse`)."""


# ---- what a parser accepts ------------------------------------------------------------------------------------------

def _members(hint: Any) -> list[Any]:
    """The members of a union type hint (``hint`` itself if it is not one)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(hint) for m in _members(arg)]
    return [hint]


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _plain(value: Any) -> Any:
    """``value`` as JSON-like data (a Namespace or dataclass as a dict, tuples as lists), for comparisons."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))


_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null",
          Path: "a path", os.PathLike: "a path"}


def accepts(hint: Any) -> str:
    """What a value of type ``hint`` may be, in words: ``"a number or 'auto'"``, ``"the fields of Restart
    (threshold, decay, cap) or null"``."""
    members = _members(hint)
    if len(members) > 1:
        if os.PathLike in members:  # str | os.PathLike: a path
            members = [m for m in members if m is not str]
        return " or ".join(dict.fromkeys(accepts(m) for m in members))
    if hint in _WORDS:
        return _WORDS[hint]
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        values = typing.get_args(hint)
        return repr(values[0]) if len(values) == 1 else "one of " + ", ".join(repr(v) for v in values)
    if dataclasses.is_dataclass(hint):
        return f"the fields of {hint.__name__} ({', '.join(_field_names(hint))})"
    if origin is tuple:
        words = [accepts(a) for a in typing.get_args(hint)]
        if len(set(words)) == 1 and words[0] in ("a number", "an integer"):
            return f"a list of {len(words)} {words[0].split()[-1]}s"
        return f"a list ({', '.join(words)})"
    if origin in (list, Sequence, typing.get_origin(Sequence[int])):
        return f"a list ({accepts(typing.get_args(hint)[0])} each)" if typing.get_args(hint) else "a list"
    name = getattr(hint, "__name__", str(hint))
    for base, word in ((int, "integer"), (float, "number")):  # jsonargparse's PositiveInt, NonNegativeFloat, ...
        if isinstance(hint, type) and issubclass(hint, base) and hint is not bool:
            qualifier = re.sub(r"(?<!^)([A-Z])", r" \1", name.removesuffix("Int").removesuffix("Float")).lower()
            return f"a {qualifier} {word}".replace("  ", " ")
    return name


class _Schema:
    """What ``parser`` accepts: its option strings, its keys (dests, as config files spell them), its sections
    (``data``, ``ddcl``: the keys with dotted children) and its parts (an option whose type is one or several
    settings classes, e.g. ``ddcl.restart``), with their defaults."""

    def __init__(self, parser: ArgumentParser) -> None:
        self.options: dict[str, Any] = {}
        self.keys: dict[str, Any] = {}
        self.parts: dict[str, list[type]] = {}
        for action in parser._actions:
            for option in action.option_strings:
                self.options[option] = action
            dest = action.dest
            if dest in ("help", "print_config") or dest.endswith(".help"):
                continue
            self.keys[dest] = action
            classes = [m for m in _members(getattr(action, "_typehint", None)) if dataclasses.is_dataclass(m)]
            if classes:
                self.parts[dest] = classes
        self.sections = {key.rpartition(".")[0] for key in self.keys if "." in key}
        self.sections |= {s.rpartition(".")[0] for s in list(self.sections) if "." in s}

    def is_config(self, action: Any) -> bool:
        """``--config`` or a section's own option (``--ddcl FILE``): a file or YAML text of settings."""
        return isinstance(action, ActionConfigFile) or action.dest in self.sections

    def default(self, key: str) -> Any:
        return _plain(self.keys[key].default)

    def fields(self, part: str) -> set[str]:
        return {name for cls in self.parts[part] for name in _field_names(cls)}

    def describe(self, part: str) -> str:
        """``"Restart's fields (threshold, decay, cap)"``, ``"Ema's (decay, soft) or Gradient's (term, weight)"``."""
        classes = self.parts[part]
        listed = [f"{cls.__name__}'s{' fields' if len(classes) == 1 else ''} ({', '.join(_field_names(cls))})"
                  for cls in classes]
        return " or ".join(listed)

    def names(self) -> list[str]:
        """Every flag a user may give (parts' fields too), without the ``.help`` ones."""
        flags = [o for o in self.options if o.startswith("--") and not o.endswith((".help", "+"))]
        return flags + [f"--{part}.{name}" for part in self.parts for name in sorted(self.fields(part))]

    def children(self, container: str) -> list[str]:
        """The names directly below a section or part (``"ddcl"`` -> ``temperature``, ...; ``""``: the top level)."""
        if container in self.parts:
            return [name for cls in self.parts[container] for name in _field_names(cls)]
        prefix = f"{container}." if container else ""
        out = [key[len(prefix):] for key in self.keys if key.startswith(prefix) and "." not in key[len(prefix):]]
        return list(dict.fromkeys(out))

    def suggest(self, name: str, keys: bool = False) -> str:
        """Close matches of an unknown flag (or config key, with ``keys``) and what its section accepts, as the tail
        of a message: ``"; did you mean --ddcl.restart.threshold? (--ddcl.restart takes Restart's fields ...)"``."""
        dash = "" if keys else "--"
        bare = name.removeprefix("--")
        container, _, leaf = bare.rpartition(".")
        while container and container not in self.parts and container not in self.sections:
            container = container.rpartition(".")[0]  # the nearest section or part that exists
        known = [n.removeprefix("--") for n in self.names()]
        matches = [f"{container}.{m}" if container else m  # a close name in the same section,
                   for m in difflib.get_close_matches(leaf, self.children(container), n=3, cutoff=0.6)]
        matches = matches or [n for n in known if n.rpartition(".")[2] == leaf]  # else the same name in another,
        matches = matches or difflib.get_close_matches(bare, known, n=3, cutoff=0.8)  # else a close one anywhere
        matches = list(dict.fromkeys(m for m in matches if m != bare))[:3]
        tail = f"; did you mean {' or '.join(dash + m for m in matches)}?" if matches else ""
        if container in self.parts:
            tail += f" ({dash}{container} takes {self.describe(container)})"
        elif container:
            tail += f" ({dash}{container}.* takes {', '.join(self.children(container))})"
        return tail

    def hint(self, dotted: str) -> Any:
        """The type of a key or of a part's field (``"ddcl.restart.threshold"``), ``None`` if unknown."""
        if dotted in self.keys:
            return getattr(self.keys[dotted], "_typehint", None)
        part, _, name = dotted.rpartition(".")
        for cls in self.parts.get(part, ()):
            if name in _field_names(cls):
                try:
                    return typing.get_type_hints(cls)[name]
                except Exception:  # noqa: BLE001 - an annotation that does not resolve: the message goes without it
                    return None
        return None

    def shorten(self, message: str) -> str:
        """jsonargparse's error, one line: the flag, what it accepts and the value given."""
        lines = [line.strip() for line in message.strip().splitlines()] or ["invalid arguments"]
        keys = re.findall(r'Parser key "([^"]+)"', message)
        if not keys:  # e.g. a config file that is not YAML: its lines, joined
            return " ".join(lines)
        nested = re.search(r"NestedArg\(key='([^']*)', val='([^']*)'\)", message)
        dotted = keys[0] + (f".{nested.group(1)}" if nested else "".join(f".{k}" for k in keys[1:2]))
        unknown = re.search(r"Option '([^']+)' is not accepted", message)
        if unknown and len(self.parts.get(keys[0], ())) == 1:
            return f"--{keys[0]}.{unknown.group(1)}: no such field{self.suggest(f'--{keys[0]}.{unknown.group(1)}')}"
        required = re.search(r"the following arguments are required: (\S+)", message)
        if required and keys[0] in self.parts:
            return (f"--{keys[0]} needs {required.group(1)} (--{keys[0]}.{required.group(1)}) when its other fields "
                    f"are given; it takes {self.describe(keys[0])}")
        value = nested.group(2) if nested else None
        if value is None:
            inner = message[message.find(f'Parser key "{keys[min(1, len(keys) - 1)]}"'):]  # the innermost key's
            got = re.search(r"(?:Got value|Given value|invalid literal for \w+\(\) with base 10): (.*)", inner) or \
                re.search(r"Not of type \w+: (.+) does not conform", inner)
            value = got.group(1).strip() if got else None
        if value is not None and not (len(value) > 1 and value[0] == value[-1] == "'"):
            value = repr(value)
        hint = self.hint(dotted) or self.hint(keys[0])
        expected = f"expected {accepts(hint)}" if hint is not None else \
            re.sub(r'^Parser key "[^"]+":\s*', "", lines[0]) or " ".join(lines[1:2])
        return f"--{dotted}: {expected}" + ("" if value is None else f", got {value}")


# ---- the checks before parsing ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Part:
    """What the input gave one part so far: its fields (name -> where each was given), those of them given by a
    flag, and where a whole value that is not a mapping was given (``None`` while the part has its default)."""

    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    flags: dict[str, str] = dataclasses.field(default_factory=dict)
    value: str | None = None


class _Checker:
    """One pass over ``argv`` and the config files it names, in order: refuse unknown and former names and
    contradictory parts (module docstring) before jsonargparse parses it."""

    def __init__(self, schema: _Schema, former: FormerFlags, prog: str) -> None:
        self.schema, self.former, self.prog = schema, former, prog
        self.state: dict[str, _Part] = {}
        self.formers: list[str] = []

    def fail(self, message: str, hint: bool = False) -> NoReturn:
        """Refuse the input: ``message`` (after the former names met so far), with ``hint`` a pointer to ``--help``."""
        if self.formers:
            raise UsageError("; ".join(self.formers) + "\n" + message)
        raise UsageError(message + (f"\n{self.prog} --help lists the flags" if hint else ""))

    def check(self, args: list[str]) -> list[str]:
        """Check ``args``; returns them as jsonargparse is to read them: a part's field given by a flag
        (``--ddcl.prototype_update.term l_q``) as a one-key mapping of the part (``--ddcl.prototype_update 'term:
        l_q'``), which jsonargparse merges with the part's earlier fields. Read as a nested key, jsonargparse kept only
        the last field of the second class of a union (``--ddcl.prototype_update.term l_q
        --ddcl.prototype_update.weight 2`` was a ``Gradient("free_energy", 2.0)``)."""
        out: list[str] = []
        i = 0
        while i < len(args):
            token = args[i]
            i += 1
            if token == "--":
                out.extend(args[i - 1:])
                break
            out.append(token)
            if not token.startswith("--"):
                continue
            name, eq, inline = token.partition("=")
            action = self.schema.options.get(name)
            if action is None and self.former.replacement(name) is not None:
                self.formers.append(self.former.message(name))
                continue
            value = inline if eq else args[i] if i < len(args) else None
            if action is None:
                field = self.unknown_flag(name)
                if field is not None and value is None:
                    self.fail(f"{name} needs a value: {accepts(self.schema.hint('.'.join(field)))}")
                if field is not None:
                    out[-1:] = [f"--{field[0]}", f"{field[1]}: {value}"]
                    i += 0 if eq else 1
                continue
            if self.schema.is_config(action) or action.dest in self.schema.parts:
                if value is None:
                    continue  # jsonargparse: expected one argument
                if not eq:
                    out.append(value)
                    i += 1
                if action.dest not in self.schema.parts:
                    prefix = "" if isinstance(action, ActionConfigFile) else f"{action.dest}."
                    self.config(value, prefix)
                elif isinstance(loaded := _load(value), Mapping):
                    self.fields(action.dest, loaded, lambda field, given=f"{name} {value}": f"{field} of {given}",
                                flag=True)
                else:
                    self.whole(action.dest, loaded, f"{name} {value}", flag=True)
        if self.formers:
            raise UsageError("; ".join(self.formers))
        return out

    def unknown_flag(self, name: str) -> tuple[str, str] | None:
        """A flag that is no option of the parser: ``(part, field)`` for a part's field (checked), else refused
        (a former name is kept for the one line that names them all)."""
        bare = name.removeprefix("--")
        part, _, field = bare.rpartition(".")
        if part.endswith(".init_args"):  # jsonargparse's own spelling of a part's field
            part = part.removesuffix(".init_args")
        if part in self.schema.parts and field in self.schema.fields(part):
            self.field(part, field, name, flag=True)
            return part, field
        if part in self.schema.parts and field == "class_path":
            return None
        if part in self.schema.parts:
            self.fail(f"{name}: no such field{self.schema.suggest(name)}")
        self.fail(f"{name}: no such flag{self.schema.suggest(name)}", hint=True)

    def config(self, value: str, prefix: str) -> None:
        """The settings of a ``--config`` (``prefix`` ``""``) or ``--ddcl`` (``"ddcl."``) value: a file, or YAML
        text; one jsonargparse cannot read is left to it."""
        path = Path(value)
        try:
            if path.is_file():
                where, content = str(path), yaml.safe_load(path.read_text())
            else:
                flag = f"--{prefix[:-1]}" if prefix else "--config"
                where, content = f"{flag} {value!r}", yaml.safe_load(value)
        except (OSError, yaml.YAMLError, ValueError):
            return
        if isinstance(content, Mapping):
            self.walk(content, prefix, where)

    def walk(self, content: Mapping[str, Any], prefix: str, where: str) -> None:
        """A config file's settings below ``prefix`` (``where``: the file)."""
        for name, value in content.items():
            key = f"{prefix}{name}"
            if name == "__path__" or (not prefix and name in CONFIG_EXTRA):
                continue
            if key in self.schema.parts:
                if isinstance(value, Mapping):
                    self.fields(key, value, lambda field, k=key: f"{k}.{field} in {where}", flag=False)
                else:
                    self.whole(key, value, f"{key}: {json.dumps(_plain(value))} in {where}", flag=False)
            elif key in self.schema.sections:
                if isinstance(value, Mapping):
                    self.walk(value, f"{key}.", where)
                elif isinstance(value, str):
                    self.config(value, f"{key}.")
            elif key not in self.schema.keys:
                message = self.former.message(f"--{key}", where)
                if message is not None:
                    self.formers.append(message)
                    continue
                self.fail(f"{where}: {key}: no such setting{self.schema.suggest(key, keys=True)}")

    def fields(self, part: str, value: Mapping[str, Any], where: Any, flag: bool) -> None:
        """A part given as a mapping of its fields (jsonargparse merges them into what came before); ``where(field)``
        says where each was given."""
        fields = value.get("init_args", value)  # jsonargparse's own spelling: {class_path: ..., init_args: {...}}
        if not isinstance(fields, Mapping):
            return  # jsonargparse says what is wrong
        for name in fields:
            if name != "class_path":
                self.field(part, str(name), where(name), flag)

    def whole(self, part: str, value: Any, where: str, flag: bool) -> None:
        """A part given a value that is not a mapping (``null``, ``"auto"``, a number): it replaces what came
        before; with fields of the part on the command line it is a contradiction."""
        state = self.state.setdefault(part, _Part())
        if flag and state.flags:
            self.fail(f"{where} and {next(iter(state.flags.values()))} both set --{part}: give it whole or by its "
                      f"fields ({self.schema.describe(part)}), not both")
        # A config file's default (--print_config writes every setting) is no value; a flag's is one.
        unset = not flag and _plain(value) == self.schema.default(part)
        self.state[part] = _Part(value=None if unset else where)

    def field(self, part: str, name: str, where: str, flag: bool) -> None:
        """One field of a part: it must be a field of the part's class (of one class, with the fields given before)
        and must not meet a whole value given before."""
        classes = self.schema.parts[part]
        if name not in self.schema.fields(part):
            self.fail(f"{where}: no such field{self.schema.suggest(f'{part}.{name}', keys=not flag)}")
        state = self.state.setdefault(part, _Part())
        if not any({*state.fields, name} <= set(_field_names(cls)) for cls in classes):
            mine = next(cls for cls in classes if name in _field_names(cls))
            other_name = next(n for n in state.fields if n not in _field_names(mine))
            other = next(cls for cls in classes if other_name in _field_names(cls))
            self.fail(f"{where} is {mine.__name__}'s and {state.fields[other_name]} is {other.__name__}'s: --{part} "
                      f"takes the fields of one, {self.schema.describe(part)}, not of both")
        if state.value is not None:
            self.fail(f"{where} and {state.value} both set --{part}: give it whole or by its fields "
                      f"({self.schema.describe(part)}), not both")
        state.fields[name] = where
        if flag:
            state.flags[name] = where


def _load(value: str) -> Any:
    """A flag's value as jsonargparse reads it (YAML: ``null``, a number, a mapping ...)."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value
