"""Entry points: `hivenet-router`, `hivenet-agent` and `hivenet-sim`. Builds the object graphs."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from hivenet_router.config.options import ConfigError, load, parse_args
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


def _gen_secret(args: Sequence[str]) -> int:
    """`hivenet-router gen-secret FILE`: a new shared secret, readable by its owner only."""
    import argparse
    from pathlib import Path

    from hivenet_router.transport.trust import write_secret

    parser = argparse.ArgumentParser(
        prog="hivenet-router gen-secret",
        description="Create a new random shared secret file (mode 0600) for router and agents.",
    )
    parser.add_argument("path", help="file to create; an existing file is never overwritten")
    path = Path(parse_args(parser, args).path)
    try:
        write_secret(path)
    except FileExistsError:
        return _fail("hivenet-router gen-secret", f"{path} exists; refusing to overwrite it")
    except OSError as exc:
        return _fail("hivenet-router gen-secret", f"cannot create {path}: {exc.strerror}")
    print(f"wrote a new shared secret to {path} (mode 0600); give the same file to every agent")
    return 0


def _keygen(args: Sequence[str]) -> int:
    """`hivenet-router keygen --tenant NAME`: a new client key and its auth.yaml entry."""
    import argparse
    import datetime

    from hivenet_router.auth.keys import generate

    parser = argparse.ArgumentParser(
        prog="hivenet-router keygen",
        description="Generate a client API key. Store the raw key in a secret manager; put "
        "only the printed entry (its SHA-256 hash) in auth.yaml.",
    )
    parser.add_argument("--tenant", default="my-tenant", help="owner of the key (tenant ID)")
    parser.add_argument("--name", default="", help="label of the key (default: the tenant)")
    options = parse_args(parser, args)
    from hivenet_router.auth.config import MAX_NAME

    tenant = options.tenant
    name = options.name or tenant
    if not tenant.strip() or len(tenant) > MAX_NAME or not tenant.isprintable():
        return _fail(
            "hivenet-router keygen", f"--tenant must be 1 to {MAX_NAME} printable characters"
        )
    if len(name) > MAX_NAME or not name.isprintable():
        return _fail(
            "hivenet-router keygen", f"--name must be at most {MAX_NAME} printable characters"
        )
    key = generate()
    today = datetime.datetime.now(datetime.UTC).strftime("%d-%m-%Y")
    print(f"API key (shown once): {key.raw}")
    print(f"SHA-256:              {key.sha256}")
    print(f"Preview:              {key.preview}")
    print("\nauth.yaml entry (under api.keys):\n")
    print(f'  - key_hash: "{key.sha256}"')
    print(f'    key_preview: "{key.preview}"')
    print("    metadata:")
    print(f"      name: {_yaml_string(name)}")
    print(f"      owner: {_yaml_string(tenant)}")
    print(f'      created_at: "{today}"')
    return 0


def _yaml_string(value: str) -> str:
    """`value` as a double-quoted YAML scalar on one line, escaped by the YAML library that
    reads auth.yaml back (quotes, backslashes, line breaks, characters YAML cannot carry raw;
    JSON's escapes would split characters beyond U+FFFF into surrogates YAML keeps apart)."""
    import yaml

    dumped: str = yaml.safe_dump(value, default_style='"', width=float("inf"), allow_unicode=True)
    return dumped.strip()


def _peer_id(args: Sequence[str]) -> int:
    """`hivenet-agent peer-id --identity-path FILE`: print the agent's peer ID."""
    import argparse
    from pathlib import Path

    from hivenet_router.transport.identity import Identity, IdentityError

    parser = argparse.ArgumentParser(
        prog="hivenet-agent peer-id", description="Print the peer ID of an identity file."
    )
    parser.add_argument("--identity-path", default="./agent_identity.key")
    path = Path(parse_args(parser, args).identity_path)
    try:
        identity = Identity.decode(path.read_bytes())
    except OSError as exc:
        return _fail("hivenet-agent peer-id", f"cannot read {path}: {exc.strerror}")
    except IdentityError as exc:
        return _fail("hivenet-agent peer-id", f"{path}: {exc}")
    print(identity.peer_id)
    return 0


def router_main(argv: Sequence[str] | None = None) -> int:
    from hivenet_router.config.router import RouterConfig
    from hivenet_router.router.process import RouterProcess

    return _serve(
        "hivenet-router",
        "Route OpenAI and Anthropic requests to agents.",
        RouterConfig,
        RouterProcess.build,
        argv,
        {"gen-secret": _gen_secret, "keygen": _keygen},
    )


def agent_main(argv: Sequence[str] | None = None) -> int:
    from hivenet_router.agent.process import AgentProcess
    from hivenet_router.config.agent import AgentConfig

    return _serve(
        "hivenet-agent",
        "Connect one inference engine to a Hivenet router.",
        AgentConfig,
        AgentProcess.build,
        argv,
        {"peer-id": _peer_id},
    )


class _Logs(Protocol):
    """What a process's config says about its logs."""

    @property
    def log_level(self) -> str: ...

    @property
    def log_format(self) -> str: ...


class _Serves(Protocol):
    async def serve(self, stop: asyncio.Event) -> int: ...


L = TypeVar("L", bound=_Logs)


def _serve(
    program: str,
    description: str,
    config_type: type[L],
    build: Callable[[L], _Serves],
    argv: Sequence[str] | None,
    commands: Mapping[str, Callable[[Sequence[str]], int]],
) -> int:
    """A long-running program: a subcommand when the first argument names one; else load
    the config (flag > environment > default), set up logging, build the process and serve
    it on uvloop until SIGINT or SIGTERM. A ConfigError, from loading or building, exits 2
    with one line naming the problem; otherwise the exit status is the process's."""
    args = sys.argv[1:] if argv is None else list(argv)
    command = commands.get(args[0]) if args else None
    if command is not None:
        return command(args[1:])
    try:
        config = load(config_type, args, os.environ, program, description)
        setup_logging(config.log_level, config.log_format)
        process = build(config)
    except ConfigError as exc:
        return _fail(program, str(exc))
    return run(process.serve)
