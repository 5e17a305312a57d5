"""Options `hivenet-router` and `hivenet-agent` both take, declared once.

Each is the same flag, environment variable, default and parser in both processes (an
operator sets GOLOG_LOG_LEVEL or HIVENET_ROUTER_JWT_SECRET once for a deployment); only the
help names the process it is read by. A config class calls these where it lists the option,
so the order of its fields, and of its table in docs/configuration.md, stays its own.
"""

from __future__ import annotations

from hivenet_router.config import values as v
from hivenet_router.config.options import ConfigError, option

LOG_FORMATS = ("text", "json")


def log_level_option(process: str, example: str) -> str:
    """--log-level / GOLOG_LOG_LEVEL; `example` shows a per-subsystem value."""
    return option(
        "info",
        parse=v.log_level,
        flag="--log-level",
        env="GOLOG_LOG_LEVEL",
        help="Log level: debug, info, warn or error, or per subsystem "
        f"({example}); any other value stops the {process}",
    )


def log_format_option() -> str:
    """--log-format / GOLOG_LOG_FMT: text or json, refused otherwise by check_log_format."""
    return option(
        "text",
        parse=v.text,
        flag="--log-format",
        env="GOLOG_LOG_FMT",
        help="Log format: text or json",
    )


def check_log_format(value: str) -> None:
    if value not in LOG_FORMATS:
        raise ConfigError(f"--log-format must be text or json, not {value!r}")


def jwt_secret_file_option(shared_with: str) -> str:
    """--jwt-secret-file: the file holding the secret router and agents share."""
    return option(
        "",
        parse=v.text,
        flag="--jwt-secret-file",
        help=f"File holding the secret shared with {shared_with}",
    )


def jwt_secret_option(secret: str) -> str:
    """HIVENET_ROUTER_JWT_SECRET: the shared secret itself, from the environment only."""
    return option(
        "",
        parse=v.text,
        env="HIVENET_ROUTER_JWT_SECRET",
        secret=True,
        help=f"The {secret} itself, when no --jwt-secret-file is given",
    )
