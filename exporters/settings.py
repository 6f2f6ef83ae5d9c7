"""The one settings mechanism of the project's command lines: the agent's subcommands
(:mod:`mrc_agent.agent.core.config` declares the sidecar's settings,
:mod:`mrc_agent.agent.tools.report.options` the report's flags) and the reference service
(:mod:`mrc_agent.reference_service.settings`), which may import nothing of the agent; hence it
lives here, beside the other code both share. Plain Python: no third-party import.

A setting is declared once, as a dataclass field made by :func:`setting`: its default, how a
value is read (``parse``) and checked (``check``), its flag, ``--help`` text, metavar and the
subcommands that offer it. :class:`Declarations` reads those fields and does the rest: the
environment names (``<PREFIX><NAME>``, where the declarations have a prefix), overlaying values
from a source (:meth:`~Declarations.apply`), the checks, and the argparse flags, whose
``--help`` shows the default taken from the declaration. A dataclass of settings may carry a
``GROUP`` title: its fields then form one ``--help`` group wherever they are composed.

Every problem is a :class:`ConfigError` with one line of text; the command line turns it into
exit code 2. Every value shown in an error is cut to :data:`SHOWN_CHARS`.
"""

from __future__ import annotations

import argparse
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(Exception):
    """A bad flag, environment variable or config file entry."""


#: Characters of a value an error message shows at most: enough to recognise it, and no more
#: of a megabyte-long value (or a nested one) than one line of a terminal.
SHOWN_CHARS = 80


class _ShortRepr(reprlib.Repr):
    """``reprlib``'s bounded repr, which also survives an integer too long for ``str()``."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 5

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters; the work is bounded
    too (a nested value is walked only a few levels and items deep)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def clipped(text: str, limit: int = 2 * SHOWN_CHARS) -> str:
    """``text`` (an exception's message, which may quote a value) cut to ``limit`` characters."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Setting:
    """How one declared field is read, checked and offered on the command line.

    ``parse`` turns a value from a file (any YAML scalar or list), the environment or a flag
    (a string) into the field's type, raising ``ValueError``/``TypeError``; ``check`` raises
    :class:`ConfigError` for a value out of range. ``commands`` lists the subcommands whose
    flags include it; ``flag`` None means no flag (``env_only``: not in a config file either).
    """

    name: str
    help: str
    parse: Callable[[Any, Any], Any]
    check: Callable[[Any, str], None] | None = None
    commands: tuple[str, ...] = ()
    flag: str | None = ""
    metavar: str | None = None
    group: str | None = None
    env_only: bool = False
    aliases: tuple[str, ...] = ()
    #: How ``--help`` shows the default, where the value itself reads badly (``100Mi``).
    default_text: str | None = None
    #: The flag may be given several times, each adding a value (``--pid 1 --pid 2``).
    repeatable: bool = False
    #: The flag's argparse type, where it is not the parser's own (``int`` for PIDs).
    flag_type: Callable[[str], Any] | None = None
    #: The values argparse accepts for the flag.
    choices: tuple[str, ...] | None = None
    #: The flag must be given.
    required: bool = False
    #: A flag without a value that switches the setting on (``--json-logs``).
    toggle: bool = False
    #: The flags of the settings sharing this name are a choice: exactly one must be given.
    one_of: str | None = None
    #: Adds the flag(s) itself: ``(parser or group, setting, help text)``, for a setting
    #: whose flags are not one ``--name VALUE`` (``--collector``/``--no-collector``).
    add_flag: Callable[[Any, Setting, str], None] | None = None
    #: Reads the value back from what :attr:`add_flag` declared (None: not given).
    read_flag: Callable[[argparse.Namespace], Any] | None = None
    #: The environment names' prefix; filled in from the declarations.
    env_prefix: str | None = None

    @property
    def env(self) -> str | None:
        return None if self.env_prefix is None else self.env_prefix + self.name.upper()

    @property
    def flag_name(self) -> str | None:
        if self.flag is None:
            return None
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dashed(self) -> str:
        return self.name.replace("_", "-")


def setting(default: Any = None, *, default_factory: Callable[[], Any] | None = None,
            **spec: Any) -> Any:
    """A dataclass field carrying its :class:`Setting` (name filled in from the field)."""
    kw: dict[str, Any] = {"metadata": {"setting": spec}}
    if default_factory is not None:
        kw["default_factory"] = default_factory
    else:
        kw["default"] = default
    return field(**kw)


def declare(cls: type, env_prefix: str | None = None) -> dict[str, Setting]:
    """The :class:`Setting` of every field of the dataclass ``cls`` made by :func:`setting`, in
    field order; the fields a class of settings with a ``GROUP`` title declares are in that
    ``--help`` group."""
    group_of: dict[str, str] = {}
    for base in cls.__mro__:
        title = base.__dict__.get("GROUP")
        if isinstance(title, str):
            for name in base.__dict__.get("__annotations__", {}):
                group_of.setdefault(name, title)
    out = {}
    for f in fields(cls):
        if "setting" not in f.metadata:  # a field of the object that is no setting
            continue
        spec = {"group": group_of.get(f.name), **f.metadata["setting"]}
        out[f.name] = Setting(name=f.name, env_prefix=env_prefix, **spec)
    return out


# -- parsers: (value, the settings read so far) -> typed value ---------------------------------

def text(value: Any, _cfg: Any) -> str | None:
    return None if value is None else str(value)


def number(value: Any, _cfg: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("expected a number")
    return float(value)


#: Whole-number settings are counts; past this a number is a mistake (and YAML's ``0b``/``0x``
#: forms can write one too long for ``str()``).
MAX_WHOLE = 1 << 62


def whole(value: Any, _cfg: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("expected a whole number")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("expected a whole number")
    n = int(value)
    if abs(n) > MAX_WHOLE:
        raise ValueError("too large")
    return n


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def switch(value: Any, name: object, what: str = "collector") -> bool:
    """A collector switch or yes/no setting: a YAML boolean, or true/false, yes/no, on/off, 1/0."""
    if isinstance(value, bool):
        return value
    said = str(value).strip().lower()
    if said in _TRUE:
        return True
    if said in _FALSE:
        return False
    raise ConfigError(f"{what} {shown(name)}: {shown(value)} is not true or false")


def yes_no(value: Any, _cfg: Any) -> bool:
    """A toggle's value (argparse's ``store_true`` gives a bool)."""
    return switch(value, "value", "setting")


# -- checks: (value, setting name) -> None or ConfigError -------------------------------------

def between(low: float, high: float, unit: str = "") -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if not low <= value <= high:
            dashed = name.replace("_", "-")
            what = f" {unit}" if unit else ""
            raise ConfigError(f"{dashed} {value:g} is out of range ({low:g}-{high:g}{what})")
    return check


def nonempty(value: str, name: str) -> None:
    if not value:
        raise ConfigError(f"{name.replace('_', '-')} must not be empty")


# -- the declarations of one command line ------------------------------------------------------

#: argparse checks the numbers a flag takes; the setting's parser checks the rest.
_FLAG_TYPES: dict[Callable[[Any, Any], Any], Callable[[str], Any]] = {number: float, whole: int}


def default_shown(spec: Setting, value: Any) -> str | None:
    """How ``--help`` and the settings reference show ``value``, the default of ``spec``;
    None when it has none."""
    if spec.default_text:
        return spec.default_text
    if value in (None, [], "", ()) or (spec.toggle and value is False):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, dict):
        return ",".join(n for n, on in value.items() if on)
    return str(value)


class Declarations:
    """The settings of the dataclass ``cls`` (groups composed into it included).

    With an ``env_prefix``, values come from sources layered by the caller (a file, the
    environment, then the flags given): every flag's argparse default is None, so that only
    the flags given override. Without one, the flags are the only source and carry the
    declared defaults themselves.
    """

    def __init__(self, cls: type, env_prefix: str | None = None) -> None:
        self.cls, self.env_prefix = cls, env_prefix
        self.specs = declare(cls, env_prefix)

    def __getitem__(self, name: str) -> Setting:
        return self.specs[name]

    def default_of(self, name: str) -> Any:
        """The default value of setting ``name``."""
        return getattr(self.cls(), name)

    def default_text(self, name: str) -> str | None:
        return default_shown(self.specs[name], self.default_of(name))

    def apply(self, cfg: Any, values: Mapping[str, Any], origin: str) -> None:
        """Overlay ``values`` (already keyed by field name) onto ``cfg``."""
        for key, value in values.items():
            spec = self.specs.get(key)
            if spec is None:
                raise ConfigError(f"{origin}: unknown setting {shown(key)}")
            try:
                parsed = spec.parse(value, cfg)
            except ConfigError as exc:
                raise ConfigError(f"{origin}: {exc}") from exc
            except (TypeError, ValueError, OverflowError) as exc:
                raise ConfigError(f"{origin}: invalid value {shown(value)} for {key} "
                                  f"({clipped(str(exc))})") from exc
            setattr(cfg, key, parsed)

    def from_env(self, env: Mapping[str, str], ignore: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every ``<PREFIX><NAME>`` (and alias) in ``env``, keyed by field name; a name with
        the prefix that is no setting (nor in ``ignore``) is refused."""
        if self.env_prefix is None:
            return {}
        by_env = {s.env: s.name for s in self.specs.values()}
        by_env.update({alias: s.name for s in self.specs.values() for alias in s.aliases})
        out: dict[str, Any] = {}
        for name, value in env.items():
            if not name.startswith(self.env_prefix) or name in ignore:
                continue
            key = by_env.get(name)
            if key is None:
                raise ConfigError(f"environment: unknown setting {clipped(name)}")
            out[key] = value
        return out

    def check(self, cfg: Any) -> Any:
        """Check every setting of ``cfg``; the first problem raises ConfigError."""
        for spec in self.specs.values():
            if spec.check is not None:
                spec.check(getattr(cfg, spec.name), spec.name)
        return cfg

    def add_flags(self, parser: argparse.ArgumentParser, command: str) -> None:
        """Add ``command``'s flags to ``parser``, each with its help, default and env name."""
        groups: dict[str, Any] = {}
        choices: dict[str, Any] = {}
        for spec in self.specs.values():
            if command not in spec.commands or spec.flag_name is None:
                continue
            target: Any = parser
            if spec.group:
                target = groups.get(spec.group) or groups.setdefault(
                    spec.group, parser.add_argument_group(spec.group))
            if spec.one_of:
                target = choices.get(spec.one_of) or choices.setdefault(
                    spec.one_of, target.add_mutually_exclusive_group(required=True))
            default = self.default_text(spec.name)
            env = f"; env {spec.env}" if spec.env else ""
            text = f"{spec.help}{f' (default {default})' if default else ''}{env}"
            if spec.add_flag is not None:
                spec.add_flag(target, spec, default or "")
                continue
            kind: dict[str, Any] = {"default": None}
            if self.env_prefix is None and not spec.required:
                kind["default"] = self.default_of(spec.name)
            if spec.toggle:
                kind["action"] = "store_true"
                kind["default"] = None if self.env_prefix else False
            else:
                kind.update(metavar=spec.metavar, choices=spec.choices,
                            type=spec.flag_type or _FLAG_TYPES.get(spec.parse, str))
                if spec.repeatable:
                    kind["action"] = "append"
                    kind["default"] = None if self.env_prefix else []
            if spec.required:
                kind["required"] = True
            target.add_argument(spec.flag_name, dest=spec.name, help=text, **kind)

    def flag_values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The settings given as flags in ``args`` (as :meth:`add_flags` declared them)."""
        out = {}
        for name, spec in self.specs.items():
            value = (spec.read_flag(args) if spec.read_flag is not None
                     else getattr(args, name, None))
            if value is not None:
                out[name] = value
        return out

    def from_args(self, args: argparse.Namespace) -> Any:
        """The settings of a command whose flags are its only source: the declared defaults,
        the flags given over them, every value parsed and checked."""
        cfg = self.cls()
        self.apply(cfg, self.flag_values(args), "command line")
        return self.check(cfg)
