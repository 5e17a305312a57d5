"""The simulator's HTTP server: OpenAI and Anthropic routes, /metrics, /health, fault admin."""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import os
import random
import struct
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from hivenet_router.config.sim import SimConfig
from hivenet_router.observability.linewriter import LineWriter
from hivenet_router.sim.choices import Choices
from hivenet_router.sim.engine import Engine, Timing, count_tokens
from hivenet_router.sim.faults import FaultDice, Faults, break_json
from hivenet_router.sim.formats import (
    ChatFormat,
    CompletionFormat,
    Format,
    MessagesFormat,
    ToolFormat,
)
from hivenet_router.sim.kv_events import KvEventPublisher
from hivenet_router.sim.metrics import render_metrics
from hivenet_router.sim.text import Corpus, chat_prompt, completion_prompt
from hivenet_router.sim.tools import forced_call, pieces, structured

log = logging.getLogger("hivenet.sim")

_JSON = "application/json"


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)


def _anthropic_error(status: int, message: str, kind: str) -> web.Response:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)


# The error type each API names for a status: OpenAI's as vLLM spells it, Anthropic's as the
# Messages API does.
_OPENAI_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def _fail(status: int, message: str, *, anthropic: bool) -> web.Response:
    """An error answer in the shape of the route's API: every error on an Anthropic route
    is Anthropic-shaped, with the type its status calls for."""
    if anthropic:
        return _anthropic_error(status, message, _ANTHROPIC_TYPES.get(status, "api_error"))
    return _error(status, message, _OPENAI_TYPES.get(status, "InternalServerError"))


def _output_limit(body: dict[str, Any]) -> Any:
    """The requested output limit, as given. The OpenAI API allows null for either field:
    null counts as absent, so {"max_tokens": 3, "max_completion_tokens": null} asks for 3."""
    requested = body.get("max_completion_tokens")
    return body.get("max_tokens") if requested is None else requested


def _choices(body: dict[str, Any]) -> int | None:
    """OpenAI's `n` (null counts as absent); None when it is no positive integer."""
    n = body.get("n")
    if n is None:
        return 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


ROUTER_SET = "X-Hivenet-Output-Bound"  # "default": the router set max_tokens, not the client


class Simulator:
    """One simulated engine and the handlers that expose it."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.faults = Faults(
            error_rate=config.fault_error_rate,
            latency=config.fault_latency,
            hang_rate=config.fault_hang_rate,
            stall_rate=config.fault_stall_rate,
            repeat_rate=config.fault_repeat_rate,
            syntax_rate=config.fault_syntax_rate,
            crash_after=config.fault_crash_after,
            slowdown=config.fault_slowdown,
        )
        # vLLM's KV-cache events on a ZeroMQ PUB socket (--kv-events-port), started by
        # the process once the event loop runs.
        self.kv_events = KvEventPublisher(config.kv_events_topic) if config.kv_events_port else None
        self.engine = Engine(
            max_num_seqs=config.max_num_seqs,
            kv_cache_tokens=config.kv_cache_tokens,
            block_size=config.block_size,
            timing=Timing(
                config.ttft_base, config.prefill_per_token, config.itl, config.batch_slowdown
            ),
            zero_latency=config.zero_latency,
            faults=self.faults,
            events=self.kv_events,
        )
        self.dice = FaultDice(self.faults, config.seed)
        self.corpus = Corpus(config.seed)
        self.requests = 0
        self.created = int(time.time())
        # The W3C trace contexts the last requests carried, for tests of trace propagation.
        self.traceparents: deque[str] = deque(maxlen=64)
        self.usage_log = (
            LineWriter(config.usage_log, what="usage log", mode=0o644) if config.usage_log else None
        )

    def close(self) -> None:
        if self.usage_log is not None:
            self.usage_log.close()

    def _log_usage(
        self, request: web.Request, prompt_tokens: int, generated: int, stream: bool, outcome: str
    ) -> None:
        """One line of the engine's own count per generation request (--usage-log)."""
        if self.usage_log is None:
            return
        line = {
            "request_id": request.headers.get("X-Request-ID", ""),
            "route": request.path,
            "model": self.config.model,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "stream": stream,
            "outcome": outcome,
        }
        self.usage_log.put(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    def app(self) -> web.Application:
        middlewares = [self._remember_trace]
        if self.config.api_key:
            middlewares.append(self._require_key)
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_post("/rerank", self.rerank)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/admin/faults", self.get_faults)
        app.router.add_post("/admin/faults", self.set_faults)
        app.router.add_post("/admin/crash", self.crash)
        app.router.add_get("/admin/traceparents", self.get_traceparents)
        return app

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: the prefix cache emptied (an AllBlocksCleared
        event with --kv-events-port)."""
        self.engine.cache.clear()
        return web.Response(status=200)

    @web.middleware
    async def _remember_trace(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        value = request.headers.get("traceparent")
        if value is not None and request.path.startswith("/v1/"):
            self.traceparents.append(value[:128])
        return await handler(request)

    async def get_traceparents(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(list(self.traceparents)), content_type=_JSON)

    @web.middleware
    async def _require_key(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """vLLM's --api-key check (same 401 body), on every route but the test-only
        /admin/*: stricter than vLLM, which leaves /health and /metrics open, so tests see
        that the agent sends the key on its probes and scrapes too."""
        if not request.path.startswith("/admin/"):
            expected = f"Bearer {self.config.api_key}".encode()
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                log.warning("refused %s %s: no valid API key", request.method, request.path)
                return web.Response(
                    status=401, body=b'{"error":"Unauthorized"}', content_type=_JSON
                )
        return await handler(request)

    # -- plain routes ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b"{}", content_type=_JSON)

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": self.created,
            "owned_by": "hivenet-sim",
            "root": self.config.model,
            "max_model_len": self.config.max_model_len,
        }
        return web.Response(
            body=orjson.dumps({"object": "list", "data": [model]}), content_type=_JSON
        )

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self.engine, self.config.model, self.requests)
        return web.Response(text=text, content_type="text/plain")

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.faults.as_dict()), content_type=_JSON)

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            changes = orjson.loads(await request.read())
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object")
            self.faults.update(changes)
        except (ValueError, orjson.JSONDecodeError) as exc:
            return _error(400, str(exc), "BadRequestError")
        log.info("faults now %s", self.faults.as_dict())
        return web.Response(body=orjson.dumps(self.faults.as_dict()), content_type=_JSON)

    async def crash(self, request: web.Request) -> web.Response:
        log.warning("crash requested through /admin/crash")
        os._exit(3)

    # -- request intake ----------------------------------------------------------------------

    async def _body(
        self, request: web.Request, *, anthropic: bool = False
    ) -> dict[str, Any] | web.Response:
        self.requests += 1
        crash_after = self.faults.crash_after
        if crash_after and self.requests >= crash_after:
            log.warning("crashing after %d requests (fault injection)", self.requests)
            os._exit(3)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _fail(400, f"invalid JSON: {exc}", anthropic=anthropic)
        if not isinstance(body, dict):
            return _fail(400, "request body must be a JSON object", anthropic=anthropic)
        model = body.get("model")
        if model != self.config.model:
            return _fail(404, f"The model `{model}` does not exist.", anthropic=anthropic)
        if self.faults.latency:
            await asyncio.sleep(self.faults.latency)
        return body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages must be a non-empty list", "BadRequestError")
        fmt = ChatFormat(self.config.model, int(time.time()))
        return await self._generate(request, body, chat_prompt(body), fmt, anthropic=False)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if "prompt" not in body:
            return _error(400, "prompt is required", "BadRequestError")
        fmt = CompletionFormat(self.config.model, int(time.time()))
        return await self._generate(request, body, completion_prompt(body), fmt, anthropic=False)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, anthropic=True)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("max_tokens"), int):
            return _anthropic_error(400, "max_tokens: Field required", "invalid_request_error")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return _anthropic_error(400, "messages: Field required", "invalid_request_error")
        fmt = MessagesFormat(self.config.model, 0)
        return await self._generate(request, body, chat_prompt(body), fmt, anthropic=True)

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = await self._body(request, anthropic=True)
        if isinstance(body, web.Response):
            return body
        tokens = count_tokens(chat_prompt(body))
        return web.Response(body=orjson.dumps({"input_tokens": tokens}), content_type=_JSON)

    # -- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt: bytes,
        fmt: Format,
        *,
        anthropic: bool,
    ) -> web.StreamResponse:
        draw = self.dice.draw()
        if draw.hang:
            await asyncio.Event().wait()
        if draw.error:
            return _fail(500, "simulated engine failure", anthropic=anthropic)
        requested = _output_limit(body)
        if requested is not None and (
            isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
        ):
            return _fail(400, "max_tokens must be a positive integer", anthropic=anthropic)
        choices = 1 if anthropic else _choices(body)
        if choices is None:
            return _fail(400, "n must be a positive integer", anthropic=anthropic)
        max_new = requested if requested is not None else self.config.output_tokens
        prompt_tokens = count_tokens(prompt)
        if prompt_tokens + max_new > self.config.max_model_len:
            return _fail(400, self._too_long(prompt_tokens, max_new), anthropic=anthropic)
        max_new, finish = self._length(requested, request.headers.get(ROUTER_SET) == "default")
        stream = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        arrived = time.monotonic()
        engine = self.engine
        seq = await engine.admit(prompt, max_new * choices)
        generated = 0
        outcome = "abort"
        try:
            delay = engine.prefill_delay(seq)
            if delay:
                await asyncio.sleep(delay)
            engine.stats.ttft.observe(time.monotonic() - arrived)
            tokens, shaped = self._answer(body, prompt, max_new, draw.repeat, fmt, anthropic)
            if shaped and draw.syntax:
                tokens = break_json(tokens)
            if shaped:
                finish = "stop"
            if choices > 1:
                fmt = Choices(fmt, choices)
            if not stream:
                per_token = engine.token_delay()
                if per_token:
                    await asyncio.sleep(per_token * len(tokens))
                    engine.stats.itl.observe(per_token)
                generated = len(tokens)
                outcome = finish
                return web.Response(
                    body=fmt.whole("".join(tokens), finish, prompt_tokens, generated),
                    content_type=_JSON,
                )
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            head = fmt.stream_start(prompt_tokens)
            stall_at = len(tokens) // 2 if draw.stall else -1
            for index, token in enumerate(tokens):
                if index == stall_at:
                    await asyncio.Event().wait()
                per_token = engine.token_delay()
                if per_token and index:
                    await asyncio.sleep(per_token)
                    engine.stats.itl.observe(per_token)
                chunk = fmt.stream_token(token)
                if head:
                    chunk, head = head + chunk, b""
                await response.write(chunk)
                generated += 1
            await response.write(fmt.stream_end(finish, prompt_tokens, generated, include_usage))
            await response.write_eof()
            outcome = finish
            return response
        except ConnectionResetError:
            # The client went away mid-answer (a load generator stopping, say): a real
            # engine aborts the sequence quietly, and so does this one.
            return web.Response(status=499)
        finally:
            engine.release(seq, outcome, generated * choices)
            self._log_usage(request, prompt_tokens, generated * choices, stream, outcome)

    def _length(self, requested: int | None, ceiling: bool) -> tuple[int, str]:
        """Tokens to generate and the finish reason. `ceiling`: the router set the limit,
        the client asked for no length, so the answer has its natural length (as a model
        stops at its end of text) unless the ceiling cuts it."""
        natural = self.config.output_tokens
        if requested is None or (ceiling and natural <= requested):
            max_new, finish = natural, "stop"
        else:
            max_new, finish = requested, "length"
        cap = self.config.answer_cap
        if cap and max_new > cap:
            max_new, finish = cap, "stop"
        return max_new, finish

    def _too_long(self, prompt_tokens: int, max_new: int) -> str:
        return (
            f"This model's maximum context length is {self.config.max_model_len} tokens. "
            f"However, you requested {prompt_tokens + max_new} tokens "
            f"({prompt_tokens} in the messages, {max_new} in the completion)."
        )

    def _answer(
        self,
        body: dict[str, Any],
        prompt: bytes,
        max_new: int,
        repeat: bool,
        fmt: Format,
        anthropic: bool,
    ) -> tuple[list[str], bool]:
        """Text from the corpus, or JSON pieces: a forced tool call's arguments, or an
        answer shaped by `response_format`. JSON answers are never cut short, so clients
        can always parse them."""
        if isinstance(fmt, ChatFormat | MessagesFormat):
            call = forced_call(body, anthropic)
            if call is not None:
                tool_fmt: ToolFormat = fmt
                tool_fmt.use_tool(call[0])
                return pieces(call[1]), True
            shaped = structured(body)
            if shaped is not None:
                return pieces(shaped), True
        return self.corpus.answer(prompt, max_new, repeat), False

    # -- embeddings and rerank ---------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        raw = body.get("input")
        items: list[Any] = raw if isinstance(raw, list) else [raw]
        if raw is None or not items:
            return _error(400, "input is required", "BadRequestError")
        as_base64 = body.get("encoding_format") == "base64"
        dim = self.config.embedding_dim
        data = []
        total = 0
        for index, item in enumerate(items):
            text = item.encode() if isinstance(item, str) else orjson.dumps(item)
            total += count_tokens(text)
            rng = random.Random(zlib.crc32(text, self.config.seed & 0xFFFFFFFF))
            vector = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
            norm = sum(x * x for x in vector) ** 0.5 or 1.0
            vector = [x / norm for x in vector]
            embedding: Any = (
                base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode() if as_base64 else vector
            )
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        out = {
            "object": "list",
            "data": data,
            "model": self.config.model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
        return web.Response(body=orjson.dumps(out), content_type=_JSON)

    async def rerank(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        query = body.get("query")
        documents = body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return _error(
                400, "query (string) and documents (list) are required", "BadRequestError"
            )
        query_words = set(query.lower().split())
        results = []
        total = count_tokens(query.encode())
        for index, doc in enumerate(documents):
            text = doc.get("text", "") if isinstance(doc, dict) else str(doc)
            words = set(str(text).lower().split())
            total += count_tokens(str(text).encode())
            overlap = len(query_words & words) / (len(query_words) or 1)
            results.append(
                {"index": index, "document": {"text": text}, "relevance_score": round(overlap, 6)}
            )
        results.sort(key=lambda item: -float(item["relevance_score"]))  # type: ignore[arg-type]
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        out = {
            "id": "rerank-" + os.urandom(8).hex(),
            "model": self.config.model,
            "usage": {"total_tokens": total},
            "results": results,
        }
        return web.Response(body=orjson.dumps(out), content_type=_JSON)
