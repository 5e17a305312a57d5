"""What the agent's session tests share: the parts of a serving agent, with no engine."""

from __future__ import annotations

from hivenet_router.agent.connection import Serving
from hivenet_router.agent.engines import adapter_for
from hivenet_router.agent.monitor import BackendMonitor, Pulse
from hivenet_router.agent.proxy import BackendProxy
from hivenet_router.config.agent import AgentConfig
from hivenet_router.http1.client import EngineClient
from hivenet_router.transport.identity import Identity
from hivenet_router.transport.tls import RouterTlsIdentity

SECRET = b"s" * 48


def serving(config: AgentConfig) -> Serving:
    """A serving agent whose backend address answers nothing (port 9)."""
    backend = EngineClient("http://127.0.0.1:9")
    return Serving(
        config=config,
        identity=Identity.generate(),
        tls=RouterTlsIdentity.from_secret(SECRET).client_context(),
        model="m",
        monitor=BackendMonitor(backend, adapter_for("vllm")),
        proxy=BackendProxy(backend, 1.0, 1.0),
        beats=Pulse(),
    )
