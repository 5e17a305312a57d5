"""Options of hivenet-router (config/router.py, checked in config/router_checks.py) refused
at start, each naming the option."""

from __future__ import annotations

import pytest

from hivenet_router.auth.config import API_MODES
from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.options import ConfigError, describe, load
from hivenet_router.config.router import AUTH_MODES, RouterConfig


def router(argv: list[str] | None = None, **env: str) -> RouterConfig:
    return load(RouterConfig, argv or [], env, "hivenet-router")


@pytest.mark.parametrize("variable", ["HIVENET_ROUTER_STAGES", "HIVENET_ROUTER_OBSERVERS"])
def test_an_empty_stage_or_observer_list_is_never_taken(variable: str) -> None:
    # An empty stage list once ran without admission (rate limits, daily budgets) or
    # wallets, silently. A list of no names is refused; a blank variable is unset, as the
    # Go router reads it: the default list applies.
    with pytest.raises(ConfigError, match=variable):
        router(**{variable: ", ,"})
    for blank in ("", " "):
        assert router(**{variable: blank}) == router()


def test_a_blank_typed_variable_is_unset_and_a_one_dash_flag_is_a_flag() -> None:
    """Found by an operator of the Go router: compose's ${X:-} left QUEUE_DEPTH blank and
    the router refused to start; and a systemd unit wrote -http-port, as Go takes it."""
    assert router(HIVENET_ROUTER_QUEUE_DEPTH="").queue_depth == router().queue_depth
    with pytest.raises(ConfigError, match="HIVENET_ROUTER_QUEUE_DEPTH"):
        router(HIVENET_ROUTER_QUEUE_DEPTH="five")
    with pytest.raises(ConfigError, match="--queue-depth"):
        router(["--queue-depth", ""])  # a flag is never unset this way
    assert router(HIVENET_ROUTER_AUDIT_LOG_PATH="").audit_log_path == ""  # text takes it
    one = router(["-http-port", "127.0.0.1:9999", "-queue-depth=7"])
    assert (one.http_port.port, one.queue_depth) == (9999, 7)


def test_stage_lists_that_name_something_are_taken() -> None:
    assert router(HIVENET_ROUTER_STAGES="admission").stages == ("admission",)
    assert router().stages == ("rate", "admission", "wallet", "cache", "validator")
    # A list whose default is empty still takes an empty value.
    assert router(HIVENET_ROUTER_CORS_ALLOWED_ORIGINS="").cors_allowed_origins == ()


def test_a_ledger_without_the_wallet_stage_is_refused() -> None:
    dsn = "postgresql://billing:S3cret@db/ledger"
    with pytest.raises(ConfigError, match="does not list wallet") as info:
        router(["--ledger-dsn", dsn], HIVENET_ROUTER_STAGES="cache,admission")
    assert "S3cret" not in str(info.value)
    taken = router(["--ledger-dsn", dsn], HIVENET_ROUTER_STAGES="wallet,admission")
    assert taken.ledger_dsn == dsn


@pytest.mark.parametrize("mode", ["api_key", "apikey", "None", "static"])
def test_an_unknown_auth_mode_is_refused_with_the_list(mode: str) -> None:
    with pytest.raises(ConfigError, match="HIVENET_ROUTER_AUTH_MODE") as info:
        router(HIVENET_ROUTER_AUTH_MODE=mode)
    assert "none, api-key, dynamic" in str(info.value)
    # Blank, it is unset (as the Go router reads it): the default mode.
    assert router(HIVENET_ROUTER_AUTH_MODE="").auth_mode == router().auth_mode


def test_the_documented_auth_modes_are_taken() -> None:
    assert AUTH_MODES == API_MODES  # the same list auth.yaml's api.mode takes
    for mode in AUTH_MODES:
        assert router(HIVENET_ROUTER_AUTH_MODE=mode).auth_mode == mode


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--p2p-port", "0"], "--p2p-port"),
        (["--advertise-grpc-addr", "router-0.svc:0"], "--advertise-grpc-addr"),
        (["--p2p-announce-addr", "/dns4/r.example/tcp/0"], "--p2p-announce-addr"),
        (["--p2p-announce-addr", "/ip4/10.0.0.1/tcp/0/tls/ws"], "--p2p-announce-addr"),
    ],
)
def test_port_zero_is_never_announced_to_agents(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        router(argv)


def test_the_disk_ttl_is_bounded() -> None:
    with pytest.raises(ConfigError, match="--disk-db-ttl"):
        router(["--disk-db-ttl", "9" * 400])
    assert router(["--disk-db-ttl", "36500"]).disk_db_ttl == 36500


@pytest.mark.parametrize("config", [RouterConfig, AgentConfig])
def test_an_unknown_log_level_is_refused(config: type[object]) -> None:
    with pytest.raises(ConfigError, match="GOLOG_LOG_LEVEL"):
        load(config, [], {"GOLOG_LOG_LEVEL": "verbose"}, "p")
    with pytest.raises(ConfigError, match="--log-level"):
        load(config, ["--log-level", "router=loud"], {}, "p")
    assert load(config, ["--log-level", "router=debug,info"], {}, "p")


def test_the_listen_defaults_are_every_interface() -> None:
    config = router()
    assert [str(a) for a in (config.http_port, config.grpc_port, config.metrics_port)] == [
        ":8080",
        ":50051",
        ":2112",
    ]


def test_the_site_id_names_the_site_when_sync_site_does_not() -> None:
    # The Go router's --site-id also names the site in the store; a deployment that set
    # only it keeps its keys when it switches.
    assert router().site == "default"
    assert router(["--site-id", "eu-west"]).site == "eu-west"
    assert router(HIVENET_ROUTER_SITE_ID="eu-west").site == "eu-west"
    assert router(["--site-id", "eu-west", "--sync-site", "shared"]).site == "shared"
    with pytest.raises(ConfigError, match="--site-id"):
        router(["--site-id", "eu west"])


def test_the_console_is_on_unless_turned_off() -> None:
    assert router().console is True
    assert router(["--console"]).console is True
    assert router(["--console=false"]).console is False
    assert router(HIVENET_ROUTER_CONSOLE="false").console is False
    assert router(["--console=true"], HIVENET_ROUTER_CONSOLE="false").console is True


def test_the_startup_banner_shows_no_password_a_url_carries() -> None:
    config = router(HIVENET_ROUTER_OPENAI_BASE_URL="https://user:s3cret@proxy.example/v1")
    shown = describe(config)
    assert "s3cret" not in str(shown)
    assert shown["HIVENET_ROUTER_OPENAI_BASE_URL"] == "https://<redacted>@proxy.example/v1"
