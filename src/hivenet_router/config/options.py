"""Declare an option once; get its flag, environment variable, default, help and docs from it.

A config class is a frozen dataclass whose fields are made with `option(...)`. The loader
builds the argument parser from the fields, applies the precedence flag > environment >
default, and parses every value with the field's parser. A bad value stops the process with a
message that names the flag (and the variable, when it came from there). Unlike the Go router,
which silently ignores an invalid typed environment value, this refuses to start. An empty
environment value (blank, as `${X:-}` in a compose file leaves it) of an option that would
refuse it is unset, as in the Go router: the flag or default applies. Text, and lists where
none is a plain setting (keys, origins, tags), take it as their value (an empty audit path
is no audit log). A flag is never unset this way: `--queue-depth ""` is refused. A flag may
be written with one dash, as Go's flag package takes it (`-http-port`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hivenet_router.config import values

T = TypeVar("T")
C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class OptionSpec:
    flag: str | None
    env: str | None
    parse: Callable[[str], Any]
    help: str
    default_text: str
    secret: bool = False
    show: Callable[[Any], str] | None = None


def option(
    default: T,
    *,
    parse: Callable[[str], T],
    help: str,
    flag: str | None = None,
    env: str | None = None,
    default_text: str | None = None,
    secret: bool = False,
    show: Callable[[T], str] | None = None,
) -> T:
    """Declare one option. Returns a dataclass field typed as the option's value."""
    if flag is None and env is None:
        raise ValueError("an option needs a flag, an environment variable, or both")
    spec = OptionSpec(
        flag=flag,
        env=env,
        parse=parse,
        help=help,
        default_text=default_text
        if default_text is not None
        else (show(default) if show else _show(default)),
        secret=secret,
        show=show,
    )
    # A secret stays out of the config's repr (tracebacks, debug logs), as describe()
    # keeps it out of the startup banner.
    field: T = dataclasses.field(default=default, metadata={"option": spec}, repr=not secret)
    return field


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(_no_userinfo(str(item)) for item in value)
    return _no_userinfo(str(value))


# The user and password a URL may carry (`https://user:pass@host`): never shown.
_USERINFO = re.compile(r"(://)[^/@\s]*@")


def _no_userinfo(text: str) -> str:
    return _USERINFO.sub(r"\1<redacted>@", text) if "@" in text else text


class ConfigError(Exception):
    """An option value that cannot be used. The message names the option."""


def read_secret_file(path: str, origin: str) -> str:
    """A secret file's text without surrounding blanks. Raises ConfigError naming `origin`
    (the flag and the path), never the content, when it cannot be read, is not UTF-8, or is
    empty: an empty file is a secret that was not mounted, not a wish for none."""
    try:
        with open(path, encoding="utf-8") as handle:
            secret = handle.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {origin}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{origin} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(f"{origin} is empty")
    return secret


def specs(config_type: type[Any]) -> list[tuple[str, OptionSpec]]:
    return [
        (field.name, field.metadata["option"])
        for field in dataclasses.fields(config_type)
        if "option" in field.metadata
    ]


# What an unknown option may be echoed as: a flag name made of short words, or one letter.
# Anything else (the value of a mistyped --ledger-dsn, a key passed where a flag was meant,
# a long random-looking word) is counted, never shown: argparse's own message would print
# every unrecognised token, passwords included.
_SHOWABLE_FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9]{0,23}(?:[-_][A-Za-z0-9]{1,24})*|-[A-Za-z]")


def unrecognised(extra: Sequence[str], known: Sequence[str]) -> str:
    """The error for arguments no option took: unknown flag names (with the closest known
    flag), and how many other tokens there were, without their text."""
    flags: list[str] = []
    hidden = 0
    for token in extra:
        name = token.split("=", 1)[0]
        if len(name) <= 40 and _SHOWABLE_FLAG.fullmatch(name):
            close = difflib.get_close_matches(name, known, n=1)
            flags.append(f"{name} (did you mean {close[0]}?)" if close else name)
        else:
            hidden += 1
    parts = []
    if flags:
        parts.append(f"unrecognized option{'s' if len(flags) > 1 else ''}: {', '.join(flags)}")
    if hidden:
        parts.append(
            f"{hidden} unexpected argument{'s' if hidden > 1 else ''} (not shown: "
            "an argument may hold a secret)"
        )
    return "; ".join(parts)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown argument is reported by `unrecognised`, and a
    long flag written with one dash (`-http-port`, as Go's flag package takes it) is read
    as with two."""
    known = parser._option_string_actions
    argv = [_two_dashes(arg, known) for arg in argv]
    namespace, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(unrecognised(extra, sorted(parser._option_string_actions)))
    return namespace


def _two_dashes(arg: str, known: Mapping[str, object]) -> str:
    if len(arg) > 2 and arg[0] == "-" and arg[1] != "-":
        name = "-" + arg.partition("=")[0]
        if name in known:
            return "-" + arg
    return arg


def build_parser(config_type: type[Any], prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for name, spec in specs(config_type):
        if spec.flag is None:
            continue
        env_note = f" [env {spec.env}]" if spec.env else ""
        is_bool = spec.default_text in {"true", "false"}
        parser.add_argument(
            spec.flag,
            dest=name,
            default=None,
            metavar="BOOL" if is_bool else "VALUE",
            nargs="?" if is_bool else None,
            const="true" if is_bool else None,
            # argparse formats help with %: a literal one ("20%") must be doubled.
            help=f"{spec.help} (default: {spec.default_text or 'empty'}){env_note}".replace(
                "%", "%%"
            ),
        )
    return parser


def load(
    config_type: type[C],
    argv: Sequence[str],
    environ: Mapping[str, str],
    prog: str,
    description: str = "",
) -> C:
    """Build a config from flags, then environment, then defaults. Raises ConfigError."""
    parser = build_parser(config_type, prog, description)
    namespace = parse_args(parser, argv)
    values: dict[str, Any] = {}
    for name, spec in specs(config_type):
        raw = getattr(namespace, name, None)
        origin = spec.flag or ""
        if raw is None and spec.env is not None and spec.env in environ:
            raw = environ[spec.env]
            origin = f"{spec.env} (environment)"
            if spec.flag:
                origin = f"{spec.flag} / {spec.env} (environment)"
            if not raw.strip() and not _takes(spec, raw):
                continue  # blank: unset, as the Go router reads it
        if raw is None:
            continue
        try:
            values[name] = spec.parse(raw)
        except ValueError as exc:
            shown = "<redacted>" if spec.secret else repr(raw)
            raise ConfigError(f"invalid value {shown} for {origin}: {exc}") from None
    config = config_type(**values)
    check = getattr(config, "validate", None)
    if callable(check):
        check()
    return config


def _takes(spec: OptionSpec, raw: str) -> bool:
    try:
        spec.parse(raw)
    except ValueError:
        return False
    return True


def describe(config: object) -> dict[str, str]:
    """The resolved configuration, for the startup banner. Secrets are masked."""
    shown: dict[str, str] = {}
    for name, spec in specs(type(config)):
        value = getattr(config, name)
        label = spec.flag or spec.env or name
        if spec.secret:
            shown[label] = "<set>" if value else "<empty>"
        else:
            shown[label] = spec.show(value) if spec.show else _show(value)
    return shown


def markdown_table(config_type: type[Any]) -> str:
    """The reference table for docs/configuration.md, generated from the declarations."""
    lines = [
        "| Flag | Environment variable | Default | Description |",
        "| --- | --- | --- | --- |",
    ]
    for _name, spec in specs(config_type):
        flag = f"`{spec.flag}`" if spec.flag else "-"
        env = f"`{spec.env}`" if spec.env else "-"
        default = f"`{spec.default_text}`" if spec.default_text else "empty"
        lines.append(f"| {flag} | {env} | {default} | {spec.help} |")
    return "\n".join(lines)


def duration_option(
    default: float,
    *,
    help: str,
    flag: str | None = None,
    env: str | None = None,
    positive: bool = True,
) -> float:
    """A duration option: accepts `500ms`, `5s`, `1h30m`; holds seconds."""
    return option(
        default,
        parse=values.positive_duration if positive else values.duration,
        help=help,
        flag=flag,
        env=env,
        show=values.format_duration,
    )
