"""Every option of `hivenet-agent`, declared once."""

from __future__ import annotations

from dataclasses import dataclass

from hivenet_router.config import values as v
from hivenet_router.config.options import (
    ConfigError,
    duration_option,
    option,
    read_secret_file,
)
from hivenet_router.config.shared import (
    check_log_format,
    jwt_secret_file_option,
    jwt_secret_option,
    log_format_option,
    log_level_option,
)
from hivenet_router.domain.agent import CAPABILITIES, ENGINE_ALIASES, engine_name
from hivenet_router.domain.agent import ENGINES as AGENT_ENGINES

# Every name --engine takes, aliases included.
ENGINES = (*AGENT_ENGINES, *ENGINE_ALIASES)
# The most a router takes at registration (domain/agent.py, Registration.capacity): one
# more started, then was refused by every router on every retry (found by a new user).
MAX_CAPACITY = 1_000_000


_capacity = v.at_most(
    v.positive_int, MAX_CAPACITY, "{value} is over " + f"{MAX_CAPACITY}, the most a router takes"
)


def _engine(value: str) -> str:
    name = engine_name(value)
    if name is None:
        raise ValueError(f"unknown engine {value!r}; use one of {', '.join(ENGINES)}")
    return name


def _capability(value: str) -> str:
    name = value.strip().lower()
    if name not in CAPABILITIES:
        raise ValueError(f"unknown capability {value!r}; use one of {', '.join(CAPABILITIES)}")
    return name


def _router_list(value: str) -> tuple[v.ListenAddress, ...]:
    """`host:port,host:port`, trimmed, each a dial address; an address given twice counts
    once."""
    found: list[v.ListenAddress] = []
    for item in v.comma_list(value):
        try:
            address = v.host_port(item)
        except ValueError as error:
            why = str(error) if ":" in item else "give HOST:PORT (example: router-0.svc:50051)"
            raise ValueError(f"router {item!r}: {why}") from None
        if address not in found:
            found.append(address)
    return tuple(found)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    engine: str = option(
        "vllm",
        parse=_engine,
        flag="--engine",
        help="Engine adapter: vllm, sglang, llamacpp (or llama-cpp), ollama, infinity, custom, "
        "openai (any OpenAI-compatible server)",
    )
    backend_url: str = option(
        "http://localhost:8888",
        parse=v.http_url,
        flag="--backend-url",
        help="Base URL of the local inference server",
    )
    model: str = option(
        "",
        parse=v.text,
        flag="--model",
        help="Model ID to register; empty means discover it from the backend "
        "(/v1/models; Ollama's /api/tags)",
    )
    health_url: str = option(
        "",
        parse=v.optional_http_url,
        flag="--health-url",
        help="Health endpoint of the backend; required for the custom engine",
    )
    capability: str = option(
        "llm",
        parse=_capability,
        flag="--capability",
        help="llm, embedding or reranker",
    )
    capacity: int = option(
        10,
        parse=_capacity,
        flag="--capacity",
        help="Most requests the router may assign to this agent at once",
    )
    router_grpc: v.ListenAddress = option(
        v.host_port("localhost:50051"),
        parse=v.host_port,
        flag="--router-grpc",
        help="Router authentication address, used when --routers is empty; its answer names "
        "the data-connection address",
    )
    routers: tuple[v.ListenAddress, ...] = option(
        (),
        parse=_router_list,
        flag="--routers",
        env="HIVENET_AGENT_ROUTERS",
        help="Comma-separated HOST:PORT authentication addresses of every router of the site "
        "(DNS names allowed, one per router, never a load balancer); one session per router, "
        "and routers they list are found and joined too",
    )
    router_p2p: str = option(
        "/ip4/127.0.0.1/tcp/9000",
        parse=v.text,
        flag="--router-p2p",
        help="Deprecated and ignored; the router announces its address during authentication",
    )
    p2p_listen_port: int = option(
        0,
        parse=v.port,
        flag="--p2p-listen-port",
        help="Accepted for compatibility; the agent only dials out and listens on nothing",
    )
    identity_path: str = option(
        "./agent_identity.key",
        parse=v.text,
        flag="--identity-path",
        help="Persistent Ed25519 identity file; created with mode 0600 if missing",
    )
    jwt_secret_file: str = jwt_secret_file_option("the router")
    jwt_secret: str = jwt_secret_option("shared secret")
    backend_api_key_file: str = option(
        "",
        parse=v.text,
        flag="--backend-api-key-file",
        help="File holding the API key the engine was started with (--api-key of vLLM, "
        "SGLang, llama.cpp); sent as Authorization: Bearer on every backend request",
    )
    backend_api_key: str = option(
        "",
        parse=v.text,
        env="HIVENET_AGENT_BACKEND_API_KEY",
        secret=True,
        help="The backend API key itself, when no --backend-api-key-file is given",
    )
    http_timeout: float = duration_option(
        120.0,
        flag="--http-timeout",
        help="Timeout of one backend request up to its answer's head (enforced to within 50 "
        "ms after it, never before); a stream then lasts as long as the router reads it",
    )
    stream_write_timeout: float = duration_option(
        60.0,
        flag="--stream-write-timeout",
        positive=False,
        help="Rolling timeout for the router to accept each streamed chunk; 0 disables it",
    )
    engine_sample_interval: float = duration_option(
        0.5,
        flag="--engine-sample-interval",
        help="Period of engine /metrics scrapes",
    )
    hardware_sample_interval: float = duration_option(
        2.0,
        flag="--hardware-sample-interval",
        help="Period of CPU and memory sampling",
    )
    gpu_devices_file: str = option(
        "",
        parse=v.text,
        flag="--gpu-devices-file",
        help="File of NVIDIA GPU UUIDs to report (comma or line separated; none for none)",
    )
    kv_events_endpoint: str = option(
        "",
        parse=v.text,
        flag="--kv-events-endpoint",
        help="The engine's KV-cache event publisher, tcp://HOST:PORT (vLLM's "
        "--kv-events-config endpoint, ZeroMQ PUB): its evictions and resets keep the picture "
        "of the engine's prefix cache the agent gives the routers true; empty: none",
    )
    kv_events_topic: str = option(
        "",
        parse=v.text,
        flag="--kv-events-topic",
        help="Topic to subscribe to at --kv-events-endpoint (vLLM's kv-events-config topic)",
    )
    routing_signal_interval: float = duration_option(
        0.5,
        flag="--routing-signal-interval",
        help="Least time between routing-signal pushes (sent when a new sample changed them)",
    )
    backend_check_interval: float = duration_option(
        2.0,
        flag="--backend-check-interval",
        help="Period of backend health checks; three failures in a row mark it unhealthy",
    )
    shutdown_grace: float = duration_option(
        25.0,
        flag="--shutdown-grace",
        env="HIVENET_AGENT_SHUTDOWN_GRACE",
        positive=False,
        help="On SIGTERM, how long requests in flight may finish while the routers send the "
        "agent nothing new; 0 stops at once",
    )
    reconnect_delay: float = duration_option(
        5.0,
        flag="--reconnect-delay",
        help="Wait before each reconnection to the router, give or take 20% (jitter)",
    )
    session_retry_interval: float = duration_option(
        30.0,
        flag="--session-retry-interval",
        help="Wait before retrying a failed session renewal",
    )
    backend_ready_timeout: float = duration_option(
        0.0,
        flag="--backend-ready-timeout",
        positive=False,
        help="Give up if the backend is not ready in time; 0 waits forever",
    )
    region: str = option("UE-France", parse=v.text, flag="--region", help="Location label")
    organization: str = option(
        "Unknown",
        parse=v.text,
        flag="--organization",
        help="Operator or provider label",
    )
    machine: str = option("Unknown", parse=v.text, flag="--machine", help="Machine label")
    tags: tuple[str, ...] = option(
        ("production",),
        parse=v.comma_list,
        flag="--tags",
        help="Comma-separated routing tags",
    )
    gpu_model: str = option(
        "",
        parse=v.text,
        flag="--gpu-model",
        env="HIVENET_ROUTER_GPU_MODEL",
        help="Operator-defined GPU label",
    )
    deployment_id: str = option(
        "",
        parse=v.text,
        flag="--deployment-id",
        env="HIVENET_ROUTER_DEPLOYMENT_ID",
        help="Deployment identifier",
    )
    replica_id: str = option(
        "",
        parse=v.text,
        flag="--replica-id",
        env="HIVENET_ROUTER_REPLICA_ID",
        help="Stable replica identifier",
    )
    version: str = option("dev", parse=v.text, flag="--version", help="Version label")
    hide_llm: bool = option(
        False,
        parse=v.boolean,
        flag="--hide-llm",
        help="Set the model's hide_llm metadata flag",
    )
    llm_pretty_name: str = option(
        "",
        parse=v.text,
        flag="--llm-pretty-name",
        help="Human-readable model name",
    )
    llm_info: str = option("", parse=v.text, flag="--llm-info", help="Short model description")
    log_level: str = log_level_option("agent", "agent=debug,p2p=info")
    log_format: str = log_format_option()

    @property
    def router_addresses(self) -> tuple[v.ListenAddress, ...]:
        """The routers the agent starts from: --routers, else --router-grpc alone."""
        return self.routers or (self.router_grpc,)

    def validate(self) -> None:
        if self.engine == "custom" and not (self.model and self.health_url):
            raise ConfigError("--engine custom needs both --model and --health-url")
        if self.engine == "ollama" and self.capability == "reranker":
            raise ConfigError("--engine ollama cannot serve --capability reranker")
        check_log_format(self.log_format)
        if self.kv_events_endpoint:
            kv_events_address(self.kv_events_endpoint)


def kv_events_address(endpoint: str) -> tuple[str, int]:
    """(host, port) of a tcp://HOST:PORT endpoint; ConfigError for anything else."""
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == endpoint or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--kv-events-endpoint {endpoint!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def load_backend_api_key(config: AgentConfig) -> str:
    """The backend API key, read once at start: from --backend-api-key-file (trailing
    whitespace stripped), else HIVENET_AGENT_BACKEND_API_KEY; empty when neither is set.

    Raises ConfigError naming the source, never the key.
    """
    path = config.backend_api_key_file
    if path:
        origin = f"--backend-api-key-file {path}"
        key = read_secret_file(path, origin)
    else:
        origin = "HIVENET_AGENT_BACKEND_API_KEY"
        key = config.backend_api_key.strip()
    # It travels in a header: anything but visible ASCII would break every request.
    if not all("!" <= char <= "~" for char in key):
        raise ConfigError(
            f"the backend API key from {origin} holds a space, control or non-ASCII "
            "character; only visible ASCII can be sent in an Authorization header"
        )
    return key
