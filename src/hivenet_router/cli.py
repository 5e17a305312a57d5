"""Entry points: `hivenet-router`, `hivenet-agent` and `hivenet-sim`. Builds the object graphs."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from hivenet_router.config.options import ConfigError, load
from hivenet_router.runtime import run, setup_logging

log = logging.getLogger("hivenet.cli")


def _fail(program: str, message: str) -> int:
    print(f"{program}: {message}", file=sys.stderr)
    return 2


def sim_main(argv: Sequence[str] | None = None) -> int:
    from hivenet_router.config.sim import SimConfig
    from hivenet_router.sim.process import serve

    try:
        config = load(
            SimConfig,
            sys.argv[1:] if argv is None else argv,
            os.environ,
            "hivenet-sim",
            "Simulated OpenAI- and Anthropic-compatible engine.",
        )
    except ConfigError as exc:
        return _fail("hivenet-sim", str(exc))
    setup_logging("info", "text")
    return serve(config)


def router_main(argv: Sequence[str] | None = None) -> int:
    from hivenet_router.config.router import RouterConfig
    from hivenet_router.router.process import RouterProcess

    try:
        config = load(
            RouterConfig,
            sys.argv[1:] if argv is None else argv,
            os.environ,
            "hivenet-router",
            "Route OpenAI and Anthropic requests to agents.",
        )
        setup_logging(config.log_level, config.log_format)
        process = RouterProcess.build(config)
    except ConfigError as exc:
        return _fail("hivenet-router", str(exc))

    async def main(stop: asyncio.Event) -> int:
        return await process.serve(stop)

    return run(main)


def agent_main(argv: Sequence[str] | None = None) -> int:
    from hivenet_router.agent.process import AgentProcess
    from hivenet_router.config.agent import AgentConfig

    try:
        config = load(
            AgentConfig,
            sys.argv[1:] if argv is None else argv,
            os.environ,
            "hivenet-agent",
            "Connect one inference engine to a Hivenet router.",
        )
        setup_logging(config.log_level, config.log_format)
        process = AgentProcess.build(config)
    except ConfigError as exc:
        return _fail("hivenet-agent", str(exc))

    async def main(stop: asyncio.Event) -> int:
        return await process.serve(stop)

    return run(main)
