"""The Responses API routes: POST /v1/responses runs as a chat completions request through
every stage (admission, budgets, wallets, the cache, the validator, dispatch) with its
answer rewritten on the way out; the others read the tenant's stored responses.

A tenant sees only its own stored responses: another tenant's ID is answered exactly as
an unknown one, `404 response_not_found`, whether it reads, lists, continues, cancels or
deletes it.
"""

from __future__ import annotations

from typing import Any

import orjson

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.responses.events import StreamShape
from hivenet_router.responses.request import ResponsesRequest, check_outputs, new_id, parse
from hivenet_router.responses.store import ResponseStore, Stored
from hivenet_router.responses.translate import chat_body, response_from_chat, skeleton
from hivenet_router.router.handlers import Handlers
from hivenet_router.router.relay import Reshape
from hivenet_router.router.requests import read_body

CHAT = "/v1/chat/completions"  # what the agent's engine is asked
PAGE_MAX = 100


class _Shape:
    """A chat answer as this request's Response; a stored request keeps it on the way."""

    def __init__(
        self,
        request: ResponsesRequest,
        base: dict[str, Any],
        store: ResponseStore | None,
        tenant: str,
        history: list[dict[str, Any]],
    ) -> None:
        self._request = request
        self._base = base
        self._store = store if request.store else None
        self._tenant = tenant
        self._history = history

    def _keep(self, response: dict[str, Any], encoded: bytes) -> None:
        if self._store is not None:
            self._store.keep(self._tenant, response, self._request.items, self._history, encoded)

    def whole(self, body: bytes) -> bytes:
        try:
            chat = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ValueError(str(exc)) from None
        if not isinstance(chat, dict):
            raise ValueError("not a JSON object")
        response = response_from_chat(self._base, chat)
        encoded = orjson.dumps(response)  # once, for the client and the store
        self._keep(response, encoded)
        return encoded

    def stream(self) -> Reshape:
        return StreamShape(self._base, self._keep)


# How much of an ID a client sent is repeated in an error: the IDs this router makes are
# far shorter, and a client's 10 KB string is not echoed back whole.
ID_CHARS = 100


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    shown = response_id[:ID_CHARS] + ("..." if len(response_id) > ID_CHARS else "")
    return ApiError(ErrorCode.RESPONSE_NOT_FOUND, f"no response with ID {shown!r}", param=param)


class ResponsesApi:
    def __init__(self, handlers: Handlers, store: ResponseStore | None, body_timeout: float):
        self.handlers = handlers
        self.store = store  # None: the store could not be opened; nothing is stored
        self.body_timeout = body_timeout

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("POST", "/v1/responses", self.create),
            ("GET", "/v1/responses/{response_id}", self.read),
            ("DELETE", "/v1/responses/{response_id}", self.delete),
            ("GET", "/v1/responses/{response_id}/input_items", self.input_items),
            ("POST", "/v1/responses/{response_id}/cancel", self.cancel),
        ]

    async def _find(self, request: Request, response_id: str, param: str | None = None) -> Stored:
        tenant = request.ticket.caller.tenant
        found = await self.store.get(tenant, response_id) if self.store is not None else None
        if found is None:
            raise _not_found(response_id, param)
        return found

    async def create(self, request: Request) -> Answer:
        body = await read_body(request, self.body_timeout)
        try:
            parsed = parse(body)
        except ApiError:
            self.handlers.refused_body(request.ticket, CHAT, body)
            raise
        history: list[dict[str, Any]] = []
        if parsed.previous_response_id is not None:
            previous = await self._find(
                request, parsed.previous_response_id, "previous_response_id"
            )
            history = previous.conversation()
        try:
            check_outputs(parsed.items, history)
        except ApiError:
            self.handlers.refused_body(request.ticket, CHAT, body)
            raise
        base = skeleton(parsed, new_id("resp"))
        shape = _Shape(parsed, base, self.store, request.ticket.caller.tenant, history)
        return await self.handlers.run(request, CHAT, chat_body(parsed, history), shape)

    async def read(self, request: Request) -> Answer:
        if request.query.get("stream") in ("true", "1"):
            raise ApiError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                "streaming a stored response is for background responses, which this "
                "router does not run",
                param="stream",
            )
        found = await self._find(request, request.match_info["response_id"])
        return Response(orjson.dumps(found.response))

    async def delete(self, request: Request) -> Answer:
        response_id = request.match_info["response_id"]
        tenant = request.ticket.caller.tenant
        if self.store is None or not await self.store.delete(tenant, response_id):
            raise _not_found(response_id)
        return Response(
            orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True})
        )

    async def cancel(self, request: Request) -> Answer:
        found = await self._find(request, request.match_info["response_id"])
        raise ApiError(
            ErrorCode.RESPONSE_NOT_CANCELLABLE,
            f"response {found.response['id']} is not a background response: only those "
            "can be cancelled, and this router runs none",
        )

    async def input_items(self, request: Request) -> Answer:
        found = await self._find(request, request.match_info["response_id"])
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(ErrorCode.INVALID_PARAMETER, "order: asc or desc", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= PAGE_MAX:
            raise ApiError(ErrorCode.INVALID_PARAMETER, f"limit: 1 to {PAGE_MAX}", param="limit")
        items = found.items if order == "asc" else found.items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                # A cursor from no page of this list: an error, not a silent end of it.
                raise ApiError(
                    ErrorCode.INVALID_PARAMETER,
                    f"after: no input item {after[:ID_CHARS]!r} in response {found.response['id']}",
                    param="after",
                )
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return Response(
            orjson.dumps(
                {
                    "object": "list",
                    "data": page,
                    "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None,
                    "has_more": len(items) > limit,
                }
            )
        )
