"""The rest of an agent's answer, read from its link stream (router/dispatch.py)."""

from __future__ import annotations

import logging

from hivenet_router.domain.answer import AnswerBroken, Outcome
from hivenet_router.domain.errors import ErrorCode
from hivenet_router.transport.link import LinkClosed, Stream, StreamReset

log = logging.getLogger("hivenet.router")


class AgentSource:
    """The rest of an agent's answer. Closing it resets the stream if it is not done."""

    __slots__ = ("_peer", "_stream")

    def __init__(self, stream: Stream, peer: str) -> None:
        self._stream = stream
        self._peer = peer

    async def read(self) -> bytes | None:
        try:
            return await self._stream.read()
        except StreamReset as exc:
            log.warning("stream from %s broke: %s", self._peer, exc)
            if isinstance(exc, LinkClosed):
                raise AnswerBroken(
                    ErrorCode.AGENT_DISCONNECTED, "the agent's connection was lost"
                ) from None
            raise AnswerBroken(
                ErrorCode.BACKEND_ERROR, "the engine stopped answering mid-stream"
            ) from None

    def close(self, outcome: Outcome) -> None:
        if not self._stream.finished:
            self._stream.reset(StreamReset("cancelled", "router abandoned the request"))
