"""How a setting is declared once and becomes a flag, an environment variable and a config
value.

A setting is a field of a small frozen dataclass (a settings group) declared with
`setting(...)`: its type (the annotation), default, help text, environment variable
(RADIXMESH_<NAME>, plus any `env` aliases) and validation (`choices`, `minimum`, `check`).
Its flag is `--<name>` with dashes, unless the declaration names another (`flag`) or more
(`aliases`). A setting typed `tuple[str, ...]` takes a list: its flag takes one or more
items (and adds more when given again), its variable a JSON array of them or one item, and a
config keyword one item or a list (an item that is a dict stands for its JSON text). A config
inherits the groups it uses; `Settings` validates every declared field on construction, then
runs the groups' cross-field checks. The groups and configs are
declared in `radixmesh.core.settings` (the engine's) and `radixmesh.core.service_settings`
(the services' and the mesh's).

From a config class come its argparse flags (`add_arguments`, `build_parser`), the config
from parsed flags (`from_args`, `parse_config`), and the flags that hand a parent's values
of the shared settings to a child process (`shared_values`, `to_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from types import NoneType
from typing import Any, ClassVar, TypeVar, get_args, get_type_hints

ENV_PREFIX = "RADIXMESH_"
METADATA_KEY = "radixmesh.setting"  # where a field keeps its Setting

S = TypeVar("S", bound="Settings")


@dataclass(frozen=True)
class Setting:
    """A field's declaration beyond its type and default (stored in the field's metadata)."""

    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # numbers only; the value must be >= it
    check: Callable[[Any], None] | None = None  # raises ValueError naming the setting
    flag: str | None = None  # the flag's name (no dashes in front) when not the field's
    aliases: tuple[str, ...] = ()  # more flag names
    env: tuple[str, ...] = ()  # more environment variables, read after RADIXMESH_<NAME>
    # Never on a command line (a launcher passes it in the environment) and never shown
    # whole: logs and /server_info show a URL without its credentials, else only "<set>".
    secret: bool = False


def setting(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    check: Callable[[Any], None] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    secret: bool = False,
) -> Any:
    """A dataclass field declared as a setting (see the module's docstring)."""
    spec = Setting(help, choices, minimum, check, flag, aliases, env, secret)
    return field(default=default, default_factory=default_factory, metadata={METADATA_KEY: spec})


def env_name(name: str) -> str:
    """The environment variable of the setting `name`."""
    return ENV_PREFIX + name.upper()


# ---- the base of every group and config -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Validates every declared field on construction, then the cross-field checks."""

    TITLE: ClassVar[str] = "options"  # the --help section of the group's flags

    def __post_init__(self) -> None:
        for declared in _declared(type(self)):
            value = getattr(self, declared.name)
            if declared.many:
                try:
                    value = as_items(value)
                except ValueError as exc:
                    raise ValueError(f"{declared.name}: {exc}") from None
                object.__setattr__(self, declared.name, value)
            declared.validate(value)
        self.cross_check()

    def cross_check(self) -> None:
        """Checks that involve several fields: a group overrides it and calls super()."""


# ---- flags and environment ------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _optional_str(text: str) -> str | None:
    return text or None


def _optional_int(text: str) -> int | None:
    return int(text) if text else None


def as_items(value: Any) -> tuple[str, ...]:
    """A list setting's value from what a caller gives: none, one item or a list or tuple of
    them; an item that is a dict stands for its JSON text."""
    if value is None:
        return ()
    items = []
    for item in value if isinstance(value, list | tuple) else [value]:
        if isinstance(item, dict):
            item = json.dumps(item)
        if not isinstance(item, str):
            raise ValueError(f"expected strings (or objects), got {item!r}")
        items.append(item)
    return tuple(items)


def _items(text: str) -> tuple[str, ...]:
    """A list setting's value as a variable spells it: a JSON array of its items, or one
    item; empty: none."""
    if not text.strip():
        return ()
    if not text.lstrip().startswith("["):
        return (text,)
    try:
        return as_items(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON array ({exc.msg})") from None


_CONVERTERS: dict[Any, Callable[[str], Any]] = {
    bool: _parse_bool,
    int: int,
    float: float,
    str: str,
    str | None: _optional_str,
    int | None: _optional_int,
    tuple[str, ...]: _items,
}


@dataclass(frozen=True)
class _Declared:
    """One setting of a config class, with what its type and its group say."""

    name: str
    spec: Setting
    kind: type  # bool, int, float or str
    optional: bool  # None allowed
    many: bool  # a list of items (tuple[str, ...])
    owner: type[Settings]  # the group that declares it
    default: Any  # MISSING when a factory makes it
    convert: Callable[[str], Any]

    @property
    def flags(self) -> list[str]:
        names = [self.spec.flag or self.name.replace("_", "-"), *self.spec.aliases]
        return ["--" + n for n in names]

    @property
    def env_names(self) -> list[str]:
        return [env_name(self.name), *self.spec.env]

    def from_env(self) -> tuple[Any, str] | None:
        """The value its first variable set in the environment gives, and that variable's
        name; None when none is set. ValueError naming a variable that does not parse."""
        for name in self.env_names:
            if name in os.environ:
                try:
                    return self.convert(os.environ[name]), name
                except (ValueError, argparse.ArgumentTypeError) as exc:
                    raise ValueError(f"{name}={os.environ[name]!r}: {exc}") from None
        return None

    def validate(self, value: Any) -> None:
        if value is None and self.optional:
            return
        spec = self.spec
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{self.name} must be one of {spec.choices}, got {value!r}")
        if spec.minimum is not None:
            number = not isinstance(value, bool) and isinstance(
                value, int if self.kind is int else (int, float)
            )
            if not number or value < spec.minimum:
                raise ValueError(f"{self.name} must be {self._at_least()}, got {value!r}")
        if spec.check is not None:
            spec.check(value)

    def _at_least(self) -> str:
        if self.kind is not int:
            return f"a number >= {self.spec.minimum:g}"
        if self.spec.minimum == 1:
            return "a positive integer"
        return f"an integer >= {self.spec.minimum:g}"


@cache
def _declared(cls: type[Settings]) -> tuple[_Declared, ...]:
    hints = get_type_hints(cls)
    declared = []
    for f in fields(cls):
        spec = f.metadata.get(METADATA_KEY)
        if spec is None:
            continue
        hint = hints[f.name]
        many = hint == tuple[str, ...]
        kinds = [str] if many else [k for k in get_args(hint) if k is not NoneType] or [hint]
        owner = next(  # the most basic class that has the field declares it
            k for k in reversed(cls.__mro__) if f.name in vars(k).get("__dataclass_fields__", {})
        )
        declared.append(
            _Declared(
                name=f.name,
                spec=spec,
                kind=kinds[0],
                optional=NoneType in get_args(hint),
                many=many,
                owner=owner,
                default=f.default,
                convert=_CONVERTERS[hint],
            )
        )
    return tuple(declared)


def _show(value: Any) -> str:
    """A value as a flag or an environment variable spells it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return " ".join(value)
    return str(value)


def _help(declared: _Declared, default: Any, source: str | None) -> str:
    text = declared.spec.help
    envs = " or ".join(declared.env_names)
    if default is MISSING:
        tail = f"env {envs}"
    elif source is not None:
        tail = f"default {_show(default) or 'empty'} from {source}"
    else:
        tail = f"default {_show(default) or 'empty'}; env {envs}"
    return f"{text} ({tail})".replace("%", "%%")


class _Items(argparse.Action):
    """A list setting's flag: its arguments are items, and the flag given again adds more;
    the first replaces what the environment or the default gave."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(given if isinstance(given, list) else ()), *values])


class _NegativeBool(argparse.Action):
    """--no-<flag>: sets its boolean setting to false."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, False)


def add_arguments(
    parser: argparse.ArgumentParser, cls: type[Settings], only: Iterable[str] | None = None
) -> None:
    """One flag per setting of `cls` (or the `only` ones), in a --help section per group,
    with the declaration's help; its default comes from the environment when set there.

    A boolean takes --<flag>, --<flag>=BOOL (true/false, yes/no, on/off, 1/0) and
    --no-<flag>; an optional value is none when empty; a list takes its items after the
    flag (none: empty)."""
    wanted = None if only is None else set(only)
    sections: dict[str, Any] = {}
    for d in _declared(cls):
        if wanted is not None and d.name not in wanted:
            continue
        section = sections.get(d.owner.TITLE)
        if section is None:
            section = sections[d.owner.TITLE] = parser.add_argument_group(d.owner.TITLE)
        try:
            default, source = d.from_env() or (d.default, None)
        except ValueError as exc:
            parser.error(str(exc))
        help_text = _help(d, default, source)
        # A factory's value is made when the config is built unless a flag or variable sets it.
        argparse_default = argparse.SUPPRESS if default is MISSING else default
        metavar = "{" + ",".join(d.spec.choices) + "}" if d.spec.choices else None
        if d.kind is bool:
            section.add_argument(*d.flags, dest=d.name, type=d.convert, nargs="?", const=True,
                                 default=argparse_default, metavar="BOOL", help=help_text)
            section.add_argument(*["--no-" + f.removeprefix("--") for f in d.flags],
                                 dest=d.name, action=_NegativeBool, default=argparse_default,
                                 help=f"the same as {d.flags[0]}=false")
        elif d.many:
            section.add_argument(*d.flags, dest=d.name, nargs="*", action=_Items,
                                 default=argparse_default, help=help_text)
        else:
            section.add_argument(*d.flags, dest=d.name, type=d.convert, metavar=metavar,
                                 default=argparse_default, help=help_text)


def build_parser(cls: type[Settings], prog: str | None = None) -> argparse.ArgumentParser:
    """A parser of every setting of `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls)
    return parser


def from_args(cls: type[S], args: argparse.Namespace) -> S:
    """`cls` from parsed flags (what `add_arguments(parser, cls)` added); validated."""
    values = {d.name: getattr(args, d.name) for d in _declared(cls) if hasattr(args, d.name)}
    return cls(**values)


def parse_config(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """`cls` from argv (default sys.argv[1:]) and the environment; a bad value exits 2."""
    parser = build_parser(cls, prog)
    args = parser.parse_args(argv)
    try:
        return from_args(cls, args)
    except ValueError as exc:
        parser.error(str(exc))


def from_environment(cls: type[S]) -> S:
    """`cls` from its environment variables alone (settings read where no flags are parsed,
    such as the native kernels'); ValueError naming a variable that does not parse."""
    values: dict[str, Any] = {}
    for d in _declared(cls):
        found = d.from_env()
        if found is not None:
            values[d.name] = found[0]
    return cls(**values)


def shared_values(config: Settings, target: type[Settings]) -> dict[str, Any]:
    """`config`'s values of the settings `target` takes from a group `config` has too: what a
    parent hands a child process so that both run with the same settings."""
    return {
        d.name: getattr(config, d.name) for d in _declared(target) if isinstance(config, d.owner)
    }


def shown(config: Settings) -> dict[str, Any]:
    """The config as logs and /server_info may show it: secrets only as set or not, and no
    credentials in URLs."""
    values = dataclasses.asdict(config)
    for d in _declared(type(config)):
        value = values[d.name]
        if isinstance(value, str) and "://" in value:
            values[d.name] = re.sub(r"//[^/@]*@", "//", value)
        elif d.spec.secret:
            values[d.name] = "<set>" if value else ""
    return values


def secrets_env(cls: type[Settings], values: Mapping[str, Any]) -> tuple[dict[str, Any],
                                                                          dict[str, str]]:
    """`values` without the secret settings, and those as environment variables: how a
    launcher hands them to a child without putting them on its command line."""
    secret = {d.name for d in _declared(cls) if d.spec.secret}
    rest = {name: value for name, value in values.items() if name not in secret}
    env = {env_name(name): _show(value) for name, value in values.items()
           if name in secret and value}
    return rest, env


def to_flags(cls: type[Settings], values: Mapping[str, Any]) -> list[str]:
    """`--flag=value` for each setting of `cls` named in `values`, as its parser reads it (a
    list: `--flag=item` for each item, or `--flag` alone for none)."""
    declared = {d.name: d for d in _declared(cls)}
    out = []
    for name, value in values.items():
        flag = declared[name].flags[0]
        if not declared[name].many:
            out.append(f"{flag}={_show(value)}")
        else:
            out += [f"{flag}={item}" for item in as_items(value)] or [flag]
    return out
