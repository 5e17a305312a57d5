"""Every option of `hivenet-router`, declared once."""

from __future__ import annotations

from dataclasses import dataclass

from hivenet_router.config import values as v
from hivenet_router.config.options import duration_option, option
from hivenet_router.config.router_checks import check
from hivenet_router.config.router_ports import PortOptions
from hivenet_router.config.shared import (
    jwt_secret_file_option,
    jwt_secret_option,
    log_format_option,
    log_level_option,
)

# The client API modes HIVENET_ROUTER_AUTH_MODE takes: auth.yaml's api.mode values
# (auth/config.py API_MODES; not imported, so that configuration does not load the auth
# package; a test keeps the two equal).
AUTH_MODES = ("none", "api-key", "dynamic")
MAX_TTL_DAYS = 36_500


# Days become seconds as a float: a bound keeps a 400-digit value from overflowing there,
# after the router has started.
_ttl_days = v.at_most(v.non_negative_int, MAX_TTL_DAYS, f"at most {MAX_TTL_DAYS} days (100 years)")


@dataclass(frozen=True, slots=True)
class RouterConfig(PortOptions):
    """Every option of `hivenet-router` (the ports' own in PortOptions)."""

    queue_size: int = option(
        0,
        parse=v.non_negative_int,
        flag="--queue-size",
        env="HIVENET_ROUTER_QUEUE_SIZE",
        help="Requests that may wait for a forwarding slot before new ones wait to enqueue; "
        "0 follows the forwarding limit: as many as it, at least 100",
    )
    enqueue_timeout: float = duration_option(
        5.0,
        flag="--enqueue-timeout",
        env="HIVENET_ROUTER_ENQUEUE_TIMEOUT",
        help="How long a request may wait for room in the global queue before 503 queue_full",
    )
    queue_depth: int = option(
        30,
        parse=v.non_negative_int,
        flag="--queue-depth",
        env="HIVENET_ROUTER_QUEUE_DEPTH",
        help="Requests that may wait per model for an agent slot; 0 disables waiting",
    )
    max_concurrent: int = option(
        0,
        parse=v.non_negative_int,
        flag="--max-concurrent",
        help="Most requests forwarded at once by this router, each held until its answer's "
        "last byte; 0 follows the fleet: the registered agents' capacities plus "
        "--queue-depth per model, at least 50 and at most --http-max-conns",
    )
    request_timeout: float = duration_option(
        60.0,
        flag="--request-timeout",
        env="HIVENET_ROUTER_REQUEST_TIMEOUT",
        help=(
            "Deadline of the router-side operation up to the answer's head: queueing, "
            "waiting for a slot, forwarding, a whole answer (enforced to within 50 ms after "
            "it, never before); a stream, once begun, is bounded by --stream-idle-timeout "
            "and --max-stream-duration instead"
        ),
    )
    stream_idle_timeout: float = duration_option(
        60.0,
        flag="--stream-idle-timeout",
        env="HIVENET_ROUTER_STREAM_IDLE_TIMEOUT",
        positive=False,
        help="Longest gap between two chunks of a streamed answer before the router ends "
        "it with a request_timeout error event; 0 disables it",
    )
    max_stream_duration: float = duration_option(
        1800.0,
        flag="--max-stream-duration",
        env="HIVENET_ROUTER_MAX_STREAM_DURATION",
        help="Longest life of a streamed answer, from the request's arrival; past it the "
        "router ends the stream with a request_timeout error event (a value "
        "below --request-timeout counts as --request-timeout)",
    )
    policy_file: str = option(
        "",
        parse=v.text,
        flag="--policy-file",
        env="HIVENET_ROUTER_POLICY_FILE",
        help="Global routing-policy YAML; empty means least-loaded with no filters",
    )
    policy_model_dir: str = option(
        "",
        parse=v.text,
        flag="--policy-model-dir",
        env="HIVENET_ROUTER_POLICY_MODEL_DIR",
        help="Directory of per-model policies; its _default.yaml is the global policy",
    )
    max_tries_per_step: int = option(
        3,
        parse=v.positive_int,
        flag="--max-tries-per-step",
        env="HIVENET_ROUTER_MAX_TRIES_PER_STEP",
        help="Forward attempts on distinct agents before the request fails",
    )
    max_request_bytes: int = option(
        10_485_760,
        parse=v.non_negative_int,
        flag="--max-request-bytes",
        env="HIVENET_ROUTER_MAX_REQUEST_BYTES",
        help="Largest request body accepted on /v1/*, in bytes; 0 means 1 GiB",
    )
    http_idle_timeout: float = duration_option(
        30.0,
        flag="--http-idle-timeout",
        env="HIVENET_ROUTER_HTTP_IDLE_TIMEOUT",
        help="A client connection that has not sent a complete request head this long after "
        "it was opened, or after its last answer, is closed",
    )
    http_body_timeout: float = duration_option(
        30.0,
        flag="--http-body-timeout",
        env="HIVENET_ROUTER_HTTP_BODY_TIMEOUT",
        help="Time to receive a whole request body once its head arrived; then 408",
    )
    http_max_conns_per_ip: int = option(
        1024,
        parse=v.positive_int,
        flag="--http-max-conns-per-ip",
        env="HIVENET_ROUTER_HTTP_MAX_CONNS_PER_IP",
        help="Most open client connections from one IPv4 address or IPv6 /56 (behind a load "
        "balancer every client shares its address: raise it there)",
    )
    stream_write_timeout: float = duration_option(
        60.0,
        flag="--stream-write-timeout",
        env="HIVENET_ROUTER_STREAM_WRITE_TIMEOUT",
        help="A client that takes nothing of an answer this long (its socket's buffers full) "
        "is treated as gone: its stream is cut and its engine slot freed",
    )
    http_max_conns: int = option(
        8192,
        parse=v.positive_int,
        flag="--http-max-conns",
        env="HIVENET_ROUTER_HTTP_MAX_CONNS",
        help="Most open client connections in all (lowered to fit the open-files limit)",
    )
    warmup: float = duration_option(
        15.0,
        flag="--warmup",
        env="HIVENET_ROUTER_WARMUP",
        positive=False,
        help="After start, a model no agent has registered yet gets 503 with Retry-After "
        "instead of 404 for this long, while agents reconnect",
    )
    shutdown_grace: float = duration_option(
        30.0,
        flag="--shutdown-grace",
        env="HIVENET_ROUTER_SHUTDOWN_GRACE",
        help="On SIGTERM, how long requests in flight may finish before they are cut",
    )
    health_check_interval: float = duration_option(
        5.0,
        flag="--health-check-interval",
        help="Period of the agent health monitor",
    )
    heartbeat_interval: float = duration_option(
        5.0,
        flag="--heartbeat-interval",
        help="Heartbeat period the router asks agents to use",
    )
    unhealthy_after: float = duration_option(
        15.0,
        flag="--unhealthy-after",
        help="Time without a heartbeat before an agent is unhealthy",
    )
    remove_after: float = duration_option(
        30.0,
        flag="--remove-after",
        help="Time without a heartbeat before an agent is removed",
    )
    session_ttl: float = duration_option(
        3600.0,
        flag="--session-ttl",
        env="HIVENET_ROUTER_SESSION_TTL",
        help="Lifetime of an agent session token; must exceed 5m",
    )
    session_renew_margin: float = duration_option(
        300.0,
        flag="--session-renew-margin",
        help="How long before expiry agents renew their session; --session-ttl must exceed it",
    )
    auth_failure_limit: int = option(
        10,
        parse=v.positive_int,
        flag="--auth-failure-limit",
        help="Failed agent authentications per source address and minute before refusing",
    )
    disk_db_path: str = option(
        "./badger_disk",
        parse=v.text,
        flag="--disk-db-path",
        env="HIVENET_ROUTER_DISK_DB_PATH",
        help="Directory of the persistent store (SQLite file hivenet.sqlite3 inside), used "
        "by one router process at a time (a lock file beside it says which)",
    )
    disk_db_ttl: int = option(
        30,
        parse=_ttl_days,
        flag="--disk-db-ttl",
        help="Days a persisted record lives without updates (at most 36500); 0 keeps records "
        "forever",
    )
    responses_store_ttl: float = duration_option(
        30 * 86400.0,
        flag="--responses-store-ttl",
        env="HIVENET_ROUTER_RESPONSES_STORE_TTL",
        help="How long a stored response (POST /v1/responses with store: true) can be "
        "read, listed and continued, from its creation",
    )
    responses_store_max_bytes: int = option(
        1 << 30,
        parse=v.positive_int,
        flag="--responses-store-max-bytes",
        env="HIVENET_ROUTER_RESPONSES_STORE_MAX_BYTES",
        help="Bytes the stored responses may take together (responses.sqlite3 in "
        "--disk-db-path); past it the oldest are deleted first",
    )
    universal_flush_interval: float = duration_option(
        30.0,
        flag="--universal-flush-interval",
        help="Period of agent-history flushes to the persistent store",
    )
    reset_disk_db: bool = option(
        False,
        parse=v.boolean,
        flag="--reset-disk-db",
        help="Delete this router's database files in --disk-db-path before opening it (not "
        "while another process holds them)",
    )
    jwt_secret_file: str = jwt_secret_file_option("agents (at least 32 bytes)")
    jwt_secret: str = jwt_secret_option("shared agent secret")
    auth_config_file: str = option(
        "",
        parse=v.text,
        flag="--auth-config-file",
        env="HIVENET_ROUTER_AUTH_CONFIG",
        help="auth.yaml: client API keys and the administrator mode",
    )
    auth_mode: str = option(
        "none",
        parse=v.choice(*AUTH_MODES),
        env="HIVENET_ROUTER_AUTH_MODE",
        help="Client API mode when no auth.yaml is given: none or dynamic (api-key needs the "
        "file); any other value stops the router",
    )
    admin_api_keys: tuple[str, ...] = option(
        (),
        parse=v.comma_list,
        env="HIVENET_ROUTER_ADMIN_API_KEYS",
        secret=True,
        help="Comma-separated raw administrator keys for /admin/*",
    )
    allow_insecure_admin: bool = option(
        False,
        parse=v.boolean,
        env="HIVENET_ROUTER_ALLOW_INSECURE_ADMIN",
        help="Allow /admin/* without keys; isolated development only",
    )
    quota_backend: str = option(
        "memory",
        parse=v.choice("memory", "badger"),
        env="HIVENET_ROUTER_QUOTA_BACKEND",
        help="memory, or badger to keep daily token totals in the persistent store",
    )
    sync_store: str = option(
        "",
        parse=v.text,
        flag="--sync-store",
        env="HIVENET_ROUTER_SYNC_STORE",
        help="valkey: share limits, daily totals and occupancy with the site's other routers",
    )
    sync_addr: str = option(
        "",
        parse=v.text,
        flag="--sync-addr",
        env="HIVENET_ROUTER_SYNC_ADDR",
        help="HOST:PORT of the site's Valkey primary (or use --sync-sentinels or --sync-cluster)",
    )
    sync_sentinels: tuple[str, ...] = option(
        (),
        parse=v.comma_list,
        flag="--sync-sentinels",
        env="HIVENET_ROUTER_SYNC_SENTINELS",
        help="Comma-separated HOST:PORT of the Sentinels that know the site's primary",
    )
    sync_cluster: tuple[str, ...] = option(
        (),
        parse=v.comma_list,
        flag="--sync-cluster",
        env="HIVENET_ROUTER_SYNC_CLUSTER",
        help="Comma-separated HOST:PORT of some nodes of a Valkey Cluster holding the site",
    )
    sync_master: str = option(
        "hivenet",
        parse=v.text,
        flag="--sync-master",
        env="HIVENET_ROUTER_SYNC_MASTER",
        help="Name the Sentinels monitor the site's primary under",
    )
    sync_password_file: str = option(
        "",
        parse=v.text,
        flag="--sync-password-file",
        env="HIVENET_ROUTER_SYNC_PASSWORD_FILE",
        help="File holding the Valkey password (Sentinels use the same one)",
    )
    sync_tls: bool = option(
        False,
        parse=v.boolean,
        flag="--sync-tls",
        env="HIVENET_ROUTER_SYNC_TLS",
        help="Speak TLS to Valkey and the Sentinels",
    )
    sync_tls_ca_file: str = option(
        "",
        parse=v.text,
        flag="--sync-tls-ca-file",
        env="HIVENET_ROUTER_SYNC_TLS_CA_FILE",
        help="CA bundle that signs the store's certificate (default: the system's)",
    )
    sync_site: str = option(
        "",
        parse=v.text,
        flag="--sync-site",
        env="HIVENET_ROUTER_SYNC_SITE",
        help="Site name prefixing every key in the store (letters, digits, . _ -; max 64)",
    )
    site_id: str = option(
        "",
        parse=v.text,
        flag="--site-id",
        env="HIVENET_ROUTER_SITE_ID",
        help="The site's name in the store when --sync-site is empty (no cross-site redirect)",
    )
    router_id: str = option(
        "",
        parse=v.text,
        flag="--router-id",
        env="HIVENET_ROUTER_ROUTER_ID",
        help="This router's stable name in the site (default: the hostname, then "
        "-PORT when --grpc-port is not 50051)",
    )
    sync_interval: float = duration_option(
        1.0,
        flag="--sync-interval",
        env="HIVENET_ROUTER_SYNC_INTERVAL",
        help="Period of a sync round with the store",
    )
    sync_min_routers: int = option(
        1,
        parse=v.positive_int,
        flag="--sync-min-routers",
        env="HIVENET_ROUTER_SYNC_MIN_ROUTERS",
        help="Routers the site has at least; divides budgets while the store is unreachable",
    )
    advertise_grpc_addr: str = option(
        "",
        parse=v.text,
        flag="--advertise-grpc-addr",
        env="HIVENET_ROUTER_ADVERTISE_GRPC_ADDR",
        help="HOST:PORT agents reach this router's --grpc-port at (not port 0); turns on discovery",
    )
    reuse_port: bool = option(
        False,
        parse=v.boolean,
        flag="--reuse-port",
        env="HIVENET_ROUTER_REUSE_PORT",
        help="Share --http-port with other router processes of this host (SO_REUSEPORT); "
        "give each its own --disk-db-path",
    )
    rpm_burst_seconds: int = option(
        0,
        parse=v.non_negative_int,
        env="HIVENET_ROUTER_RPM_BURST_SECONDS",
        help="Request-rate burst in seconds of the rate (1-59); 0 allows a full minute",
    )
    admit_fraction: float = option(
        0.9,
        parse=v.fraction,
        env="HIVENET_ROUTER_ADMIT_FRACTION",
        help="Share of a policy's admit_budget_tokens open to occupancy admission, in (0, 1]",
    )
    admit_park_timeout: float = duration_option(
        0.25,
        env="HIVENET_ROUTER_ADMIT_PARK_TIMEOUT",
        positive=False,
        help="How long an over-budget request waits for occupancy to free; 0 refuses at once",
    )
    openai_api_key: str = option(
        "",
        parse=v.text,
        env="HIVENET_ROUTER_OPENAI_API_KEY",
        secret=True,
        help="OpenAI credential for provider fallback; read once at start",
    )
    anthropic_api_key: str = option(
        "",
        parse=v.text,
        env="HIVENET_ROUTER_ANTHROPIC_API_KEY",
        secret=True,
        help="Anthropic credential for provider fallback; read once at start",
    )
    openai_base_url: str = option(
        "https://api.openai.com",
        parse=v.http_url,
        env="HIVENET_ROUTER_OPENAI_BASE_URL",
        help="Where the OpenAI provider adapter sends requests (for proxies and tests)",
    )
    anthropic_base_url: str = option(
        "https://api.anthropic.com",
        parse=v.http_url,
        env="HIVENET_ROUTER_ANTHROPIC_BASE_URL",
        help="Where the Anthropic provider adapter sends requests (for proxies and tests)",
    )
    stages: tuple[str, ...] = option(
        ("rate", "admission", "wallet", "cache", "validator"),
        parse=v.name_list,
        env="HIVENET_ROUTER_STAGES",
        help="Request stages between the edge and dispatch, in order, by name "
        "(rate, admission, wallet, cache, validator); each gateway stage acts only where "
        "turned on. A name may appear once, rate must come first and is required with "
        "admission, admission must come before wallet, and wallet before cache and "
        "validator. A list of no names is refused (it would drop rate limits, budgets and "
        "wallets); a blank variable is unset",
    )
    ledger_dsn: str = option(
        "",
        parse=v.text,
        flag="--ledger-dsn",
        env="HIVENET_ROUTER_LEDGER_DSN",
        secret=True,
        help="PostgreSQL DSN of the wallet ledger; set, it turns wallets on for every tenant "
        "(HIVENET_ROUTER_STAGES must then list wallet)",
    )
    ledger_timeout: float = duration_option(
        2.0,
        flag="--ledger-timeout",
        env="HIVENET_ROUTER_LEDGER_TIMEOUT",
        help="Longest wait for a ledger connection, then for the call on it (at most twice "
        "this), before the request goes on unbilled (fail-open)",
    )
    observers: tuple[str, ...] = option(
        ("metrics", "audit", "access"),
        parse=v.name_list,
        env="HIVENET_ROUTER_OBSERVERS",
        help="What watches requests and agents, by name (metrics, audit, access); a list of "
        "no names is refused, a blank variable is unset",
    )
    audit_log_path: str = option(
        "/var/log/hivenet-router/audit.jsonl",
        parse=v.text,
        flag="--audit-log-path",
        env="HIVENET_ROUTER_AUDIT_LOG_PATH",
        help="Audit records, one JSON line per request: a file (standard output when it "
        "cannot be opened), - for standard output, or empty for none; reopened on SIGHUP",
    )
    console: bool = option(
        True,
        parse=v.boolean,
        flag="--console",
        env="HIVENET_ROUTER_CONSOLE",
        help="Serve the operator's console at /console/ on the public port (it signs in "
        "with an administrator key and calls /admin/*); false to turn it off",
    )
    cors_allowed_origins: tuple[str, ...] = option(
        (),
        parse=v.comma_list,
        flag="--cors-allowed-origins",
        env="HIVENET_ROUTER_CORS_ALLOWED_ORIGINS",
        help="Browser origins allowed to call the API (CORS), comma-separated, or * for any; "
        "none by default",
    )
    log_level: str = log_level_option("router", "router=debug,policy=info")
    log_format: str = log_format_option()

    def validate(self) -> None:
        check(self)

    @property
    def site(self) -> str:
        """The site's name in the store."""
        return self.sync_site or self.site_id or "default"

    @property
    def body_limit(self) -> int:
        return self.max_request_bytes or 1 << 30
