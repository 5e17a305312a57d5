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


class ToolFormat(Format, Protocol):
    """A format that can answer with a tool call; its tokens are then argument pieces."""

    def use_tool(self, name: str) -> None: ...


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
        self._tool: str | None = None
        self._call_id = ""

    def use_tool(self, name: str) -> None:
        self._tool, self._call_id = name, new_id("call_")

    def _finish(self, finish: str) -> str:
        return "tool_calls" if self._tool and finish != "length" else finish

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self._tool:
            call = {"name": self._tool, "arguments": text}
            message["content"] = None
            message["tool_calls"] = [{"id": self._call_id, "type": "function", "function": call}]
        return orjson.dumps(
            {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": self._finish(finish),
                    }
                ],
                "usage": _usage(prompt_tokens, completion_tokens),
            }
        )

    def stream_start(self, prompt_tokens: int) -> bytes:
        if self._tool:
            call = {
                "index": 0,
                "id": self._call_id,
                "type": "function",
                "function": {"name": self._tool, "arguments": ""},
            }
            delta = orjson.dumps({"role": "assistant", "content": None, "tool_calls": [call]})
            return self._head + delta + b',"finish_reason":null}]}\n\n'
        return self._head + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'

    def stream_token(self, token: str) -> bytes:
        if self._tool:
            piece = orjson.dumps(token)
            return (
                self._head
                + b'{"tool_calls":[{"index":0,"function":{"arguments":'
                + piece
                + b'}}]},"finish_reason":null}]}\n\n'
            )
        return self._head + b'{"content":' + orjson.dumps(token) + b'},"finish_reason":null}]}\n\n'

    def stream_end(
        self, finish: str, prompt_tokens: int, completion_tokens: int, include_usage: bool
    ) -> bytes:
        finish = self._finish(finish)
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


_ANTHROPIC_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "abort": "end_turn",
    "tool_calls": "tool_use",
}


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
        self._tool: str | None = None
        self._call_id = ""

    def use_tool(self, name: str) -> None:
        self._tool, self._call_id = name, new_id("toolu_")

    def _stop(self, finish: str) -> str:
        return _ANTHROPIC_STOP["tool_calls" if self._tool and finish != "length" else finish]

    def _block(self, text: str) -> dict[str, Any]:
        if self._tool:
            return {
                "type": "tool_use",
                "id": self._call_id,
                "name": self._tool,
                "input": orjson.loads(text) if text else {},
                "caller": {"type": "direct"},
            }
        return {"type": "text", "text": text, "citations": None}

    def whole(self, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        return orjson.dumps(
            _anthropic_message(
                self.id,
                self.model,
                [self._block(text)],
                self._stop(finish),
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
                    "content_block": {**self._block(""), "input": {}}
                    if self._tool
                    else self._block(""),
                },
            )
        )

    def stream_token(self, token: str) -> bytes:
        if self._tool:
            return (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                b'"delta":{"type":"input_json_delta","partial_json":'
                + orjson.dumps(token)
                + b"}}\n\n"
            )
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
                        "stop_reason": self._stop(finish),
                        "stop_sequence": None,
                        "stop_details": None,
                        "container": None,
                    },
                    "usage": _anthropic_usage(prompt_tokens, completion_tokens),
                },
            )
            + self._event("message_stop", {"type": "message_stop"})
        )
