from __future__ import annotations

import pytest

from hivenet_router.router.relay import complete


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: [DONE]\n\n",
        b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ],
)
def test_the_last_event_of_an_answer_completes_it(chunk: bytes) -> None:
    assert complete(chunk)


@pytest.mark.parametrize(
    "chunk",
    [
        b"",
        b'data: {"choices":[{"delta":{"content":"[DONE]"}}]}\n\n',
        b'event: content_block_delta\ndata: {"delta":{"text":"message_stop"}}\n\n',
    ],
)
def test_any_other_chunk_leaves_it_open(chunk: bytes) -> None:
    assert not complete(chunk)
