"""Wire formats the simulator speaks: OpenAI chat and completions, Anthropic messages.

Stream chunks are assembled from pre-encoded pieces so that a zero-latency simulator spends
its time in the network stack, not in JSON encoding.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import orjson


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


class Format(Protocol):
    """How one API shapes a generated answer."""

    def whole(
        self, text: str, finish: str, prompt_tokens: int, completion_tokens: int
    ) -> bytes: ...

    def stream_start(self, prompt_tokens: int) -> bytes: ...

    def stream_token(self, token: str) -> bytes: ...

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes: ...


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChatFormat:
    def __init__(self, model: str, created: int) -> None:
        self.id = new_id("chatcmpl-")
        self.model = model
        self.created = created
        head = orjson.dumps(
            {"id": self.id, "object": "chat.completion.chunk", "created": created, "model": model}
        )[:-1]
        self._head = b"data: " + head + b',"choices":[{"index":0,"delta":'

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    def stream_start(self, prompt_tokens: int) -> bytes:
        return self._head + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def stream_token(self, token: str) -> bytes:
        return self._head + b'{"content":' + orjson.dumps(token) + b'},"finish_reason":null}]}\n\n'

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes:
        out = self._head + b'{},"finish_reason":"' + finish.encode() + b'"}]}\n\n'
        if include_usage:
            out += (
                b"data: "
                + orjson.dumps(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": _usage(prompt_tokens, completion_tokens),
                    }
                )
                + b"\n\n"
            )
        return out + b"data: [DONE]\n\n"


class CompletionFormat:
    def __init__(self, model: str, created: int) -> None:
        self.id = new_id("cmpl-")
        self.model = model
        self.created = created
        head = orjson.dumps(
            {"id": self.id, "object": "text_completion", "created": created, "model": model}
        )[:-1]
        self._head = b"data: " + head + b',"choices":[{"index":0,"text":'

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        return orjson.dumps(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    def stream_start(self, prompt_tokens: int) -> bytes:
        return b""

    def stream_token(self, token: str) -> bytes:
        return self._head + orjson.dumps(token) + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes:
        out = self._head + b'"","logprobs":null,"finish_reason":"' + finish.encode() + b'"}]}\n\n'
        if include_usage:
            usage = orjson.dumps(
                {
                    "id": self.id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": _usage(prompt_tokens, completion_tokens),
                }
            )
            out += b"data: " + usage + b"\n\n"
        return out + b"data: [DONE]\n\n"


_ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def _anthropic_usage(input_tokens: int | None, output_tokens: int) -> dict[str, Any]:
    """Usage with every field Anthropic's specification requires, the unknown ones null."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": None,
        "cache_read_input_tokens": None,
        "output_tokens_details": None,
        "server_tool_use": None,
    }


def _anthropic_message(
    msg_id: str, model: str, content: list[Any], stop: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "stop_details": None,
        "container": None,
        "usage": {**usage, "cache_creation": None, "inference_geo": None, "service_tier": None},
    }


class MessagesFormat:
    def __init__(self, model: str, created: int) -> None:
        self.id = new_id("msg_")
        self.model = model

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        return orjson.dumps(
            _anthropic_message(
                self.id,
                self.model,
                [{"type": "text", "text": text, "citations": None}],
                _ANTHROPIC_STOP[finish],
                _anthropic_usage(prompt_tokens, completion_tokens),
            )
        )

    @staticmethod
    def _event(name: str, data: object) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def stream_start(self, prompt_tokens: int) -> bytes:
        message = _anthropic_message(
            self.id, self.model, [], None, _anthropic_usage(prompt_tokens, 1)
        )
        return self._event("message_start", {"type": "message_start", "message": message}) + (
            self._event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": "", "citations": None},
                },
            )
        )

    def stream_token(self, token: str) -> bytes:
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":' + orjson.dumps(token) + b"}}\n\n"
        )

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes:
        return (
            self._event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + self._event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": _ANTHROPIC_STOP[finish],
                        "stop_sequence": None,
                        "stop_details": None,
                        "container": None,
                    },
                    "usage": _anthropic_usage(prompt_tokens, completion_tokens),
                },
            )
            + self._event("message_stop", {"type": "message_stop"})
        )
