"""Options the router and the agent share are one declaration: same flag, variable,
default and parser in both."""

from __future__ import annotations

import pytest

from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.options import ConfigError, OptionSpec, load, specs
from hivenet_router.config.router import RouterConfig
from hivenet_router.config.shared import check_log_format

SHARED = ("log_level", "log_format", "jwt_secret_file", "jwt_secret")


def _by_name(config: type[object]) -> dict[str, OptionSpec]:
    return dict(specs(config))


@pytest.mark.parametrize("name", SHARED)
def test_router_and_agent_read_a_shared_option_alike(name: str) -> None:
    router, agent = _by_name(RouterConfig)[name], _by_name(AgentConfig)[name]
    assert (router.flag, router.env, router.parse, router.default_text, router.secret) == (
        agent.flag,
        agent.env,
        agent.parse,
        agent.default_text,
        agent.secret,
    )


def test_a_log_format_other_than_text_or_json_is_refused() -> None:
    check_log_format("json")
    with pytest.raises(ConfigError, match="--log-format must be text or json, not 'xml'"):
        check_log_format("xml")
    with pytest.raises(ConfigError, match="--log-format must be text or json"):
        load(AgentConfig, ["--log-format", "xml"], {}, "hivenet-agent")
