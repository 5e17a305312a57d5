"""Provider fallback: OpenAI or Anthropic, used only after every local step is exhausted.

The original request goes to the provider unchanged except for its `model`, which becomes
the policy's provider model (no schema translation: an OpenAI provider serves the OpenAI
routes, an Anthropic provider the Anthropic ones). Credentials are read once at start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from hivenet_router.domain.answer import Answer, AnswerBroken, Outcome, Whole
from hivenet_router.domain.errors import ApiError, ErrorCode

log = logging.getLogger("hivenet.provider")

ROUTES: dict[str, frozenset[str]] = {
    "openai": frozenset({"/v1/chat/completions", "/v1/completions"}),
    "anthropic": frozenset({"/v1/messages", "/v1/messages/count_tokens"}),
}
ANTHROPIC_VERSION = "2023-06-01"
# A whole provider answer is held in memory: the same bound as an agent's answer.
MAX_BODY = 64 * 1024 * 1024
MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class ProviderRefused(ApiError):
    """The provider answered with an error status; `upstream` is that status, so that a
    request the provider judged bad is not held against the provider itself."""

    upstream: int = 0


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    name: str
    base_url: str
    api_key: str

    def headers(self, client: list[tuple[str, str]]) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.name == "openai":
            headers["Authorization"] = f"Bearer {self.api_key}"
        else:
            headers["x-api-key"] = self.api_key
            version = next((v for k, v in client if k.lower() == "anthropic-version"), None)
            headers["anthropic-version"] = version or ANTHROPIC_VERSION
            beta = next((v for k, v in client if k.lower() == "anthropic-beta"), None)
            if beta:
                headers["anthropic-beta"] = beta
        return headers


class ProviderStream:
    """A provider's streamed answer, read like an agent's."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.finished = False

    async def read(self) -> bytes | None:
        if self.finished:
            return None
        try:
            chunk = await self._response.content.readany()
        except aiohttp.ClientError as exc:
            log.warning("provider stream failed: %r", exc)
            self.finished = True
            self._response.close()
            raise AnswerBroken(ErrorCode.BACKEND_ERROR, "the provider's stream broke") from None
        if not chunk:
            self.finished = True
            self._response.release()
            return None
        return chunk

    def close(self, outcome: Outcome) -> None:
        if not self.finished:
            self.finished = True
            self._response.close()


class Providers:
    def __init__(self, configs: dict[str, ProviderConfig]) -> None:
        self._configs = configs
        self._session: aiohttp.ClientSession | None = None
        # Told of every call: provider, HTTP status (0 when unreachable), seconds to the head.
        self.on_call: Callable[[str, int, float], None] = lambda name, status, seconds: None

    @property
    def available(self) -> frozenset[str]:
        return frozenset(self._configs)

    def supports(self, name: str, route: str) -> bool:
        return name in self._configs and route in ROUTES.get(name, frozenset())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        return self._session

    async def forward(
        self,
        name: str,
        model: str,
        route: str,
        body: bytes,
        client_headers: list[tuple[str, str]],
        stream: bool,
    ) -> Answer:
        config = self._configs[name]
        try:
            request = orjson.loads(body)
            request["model"] = model
            payload = orjson.dumps(request)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ApiError(
                ErrorCode.REQUEST_INVALID, f"cannot forward to provider: {exc}"
            ) from None
        started = time.monotonic()
        try:
            response = await self._http().post(
                config.base_url + route, data=payload, headers=config.headers(client_headers)
            )
        except aiohttp.ClientError as exc:
            self.on_call(name, 0, time.monotonic() - started)
            log.warning("provider %s unreachable: %r", name, exc)
            raise ApiError(
                ErrorCode.BACKEND_ERROR, f"provider {name} could not be reached", source="backend"
            ) from None
        self.on_call(name, response.status, time.monotonic() - started)
        content_type = response.headers.get("Content-Type", "application/json")
        headers = [("content-type", content_type)]
        handed_over = False
        try:
            if response.status >= 400:
                # The provider's own words stay in the log: an authentication error there
                # quotes part of the router's provider key.
                raw = await response.content.read(MAX_ERROR_BODY)
                log.warning(
                    "provider %s answered %d: %s",
                    name,
                    response.status,
                    raw[:300].decode(errors="replace"),
                )
                raise ProviderRefused(
                    ErrorCode.BACKEND_ERROR,
                    f"provider {name} refused the request (HTTP {response.status})",
                    source="backend",
                    upstream=response.status,
                )
            if stream and content_type.startswith("text/event-stream"):
                source = ProviderStream(response)
                first = await source.read()
                handed_over = True
                return Answer(response.status, headers, source, first=first, origin=name)
            data = await _read_bounded(response, MAX_BODY)
            return Answer(response.status, headers, Whole(), body=data, origin=name)
        except AnswerBroken as exc:
            raise ApiError(exc.code, exc.message, source="backend") from None
        except aiohttp.ClientError as exc:
            log.warning("provider %s failed mid-answer: %r", name, exc)
            raise ApiError(
                ErrorCode.BACKEND_ERROR, f"provider {name} failed to answer", source="backend"
            ) from None
        finally:
            if not handed_over:
                response.release()


async def _read_bounded(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """A whole answer, refused past `limit` bytes (declared or actual)."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise ApiError(
            ErrorCode.BACKEND_ERROR, f"provider answer exceeds {limit} bytes", source="backend"
        )
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                ErrorCode.BACKEND_ERROR, f"provider answer exceeds {limit} bytes", source="backend"
            )
        parts.append(chunk)
    return b"".join(parts)
