"""Property test of the multiplexer: random mixes of streams over one real connection.

Each generated scenario runs many streams at once with random body sizes, chunking,
readers that stall, and requesters that abandon their stream part-way. Whatever the mix,
every completed stream returns exactly its bytes, every abandoned one ends in a reset, and
no stream is left behind on either side.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivenet_router.transport import frames
from hivenet_router.transport.link import INITIAL_WINDOW, Stream
from tests.linkpair import link_pair

PROTO = "/prop/1.0.0"


@dataclass(frozen=True)
class Plan:
    size: int  # bytes the requester sends; the responder echoes them back
    chunks: int  # the responder answers in this many writes
    abandon_after: int | None  # the requester stops after reading this many bytes
    stall: bool  # the requester pauses before reading, to exhaust the window


plans = st.builds(
    Plan,
    size=st.sampled_from([0, 1, 100, frames.MAX_PAYLOAD, INITIAL_WINDOW + 7, 3 * INITIAL_WINDOW]),
    chunks=st.integers(min_value=1, max_value=8),
    abandon_after=st.one_of(st.none(), st.integers(min_value=0, max_value=INITIAL_WINDOW)),
    stall=st.booleans(),
)


async def echo(stream: Stream) -> None:
    body = await stream.read_all(1 << 26)
    head = stream.request_head
    assert head is not None
    chunks = int(head.path.strip("/"))
    await stream.send_head(200, [])
    step = max(1, -(-len(body) // chunks))
    for start in range(0, len(body), step):
        await stream.write(body[start : start + step], timeout=5)
    await stream.end()


async def scenario(mix: list[Plan]) -> None:
    async with link_pair(PROTO, echo) as pair:
        client, server = pair.client, pair.server_links[0]

        async def run(index: int, plan: Plan) -> None:
            payload = bytes((index + i) % 256 for i in range(plan.size))
            async with client.request(PROTO, "POST", f"/{plan.chunks}", [], payload) as s:
                await s.response_head()
                if plan.stall:
                    await asyncio.sleep(0.05)
                got = bytearray()
                while (chunk := await s.read()) is not None:
                    got += chunk
                    if plan.abandon_after is not None and len(got) >= plan.abandon_after:
                        return  # leaving the context resets the stream
                assert bytes(got) == payload

        async with asyncio.timeout(30):
            await asyncio.gather(*(run(i, p) for i, p in enumerate(mix)))
            for _ in range(100):  # resets travel asynchronously; let them land
                if client.active_streams == 0 and server.active_streams == 0:
                    break
                await asyncio.sleep(0.01)
        assert client.active_streams == 0
        assert server.active_streams == 0
        assert not client.closed


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(plans, min_size=1, max_size=12))
def test_random_stream_mixes(mix: list[Plan]) -> None:
    asyncio.run(scenario(mix))
