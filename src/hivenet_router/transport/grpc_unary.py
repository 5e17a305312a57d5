"""One unary gRPC call over a connection the caller opened, spoken with h2.

The agent makes one gRPC call per session, the router's Authenticate. grpcio cost every
agent about 21 MiB (10 of them private to the process) and, since it cannot pin the
router's Ed25519 key, a loopback listener relaying its plaintext HTTP/2 into the pinned
TLS connection. A unary call needs little of gRPC: one HTTP/2 stream carrying a POST with
one length-prefixed message, and an answer whose status comes in trailers (or, for an
error with no message, in the headers alone). h2 (python-hyper) does the HTTP/2 framing,
flow control and HPACK; this module does the gRPC part and says why a call failed, as a
gRPC status name and its message.
"""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions

# gRPC status codes, by number (grpc/doc/statuscodes.md).
STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
# What a gRPC client makes of an HTTP status other than 200 (grpc/doc/http-grpc-status-mapping.md).
_FROM_HTTP = {
    400: "INTERNAL",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "UNIMPLEMENTED",
    429: "UNAVAILABLE",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "UNAVAILABLE",
}
MAX_ANSWER = 4 * 1024 * 1024  # grpcio's default limit on a received message
_READ = 64 * 1024


class CallFailed(Exception):
    """The call ended without an answer: `code` is a gRPC status name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


async def unary_call(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    authority: str,
    path: str,
    request: bytes,
    timeout: float,
) -> bytes:
    """Send `request` as the one message of a call to `path` ("/package.Service/Method")
    and return the answer's message. Raises CallFailed. Closes the connection."""
    headers = [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", f"{max(1, int(timeout * 1000))}m"),
    ]
    # One uncompressed message: a zero flag byte, its length (u32), the bytes.
    message = b"\x00" + len(request).to_bytes(4, "big") + request
    try:
        async with asyncio.timeout(timeout):
            return await _exchange(reader, writer, headers, message)
    except TimeoutError:
        raise CallFailed("DEADLINE_EXCEEDED", f"no answer within {timeout:g} s") from None
    except h2.exceptions.ProtocolError as exc:
        raise CallFailed("INTERNAL", f"HTTP/2 protocol error from the server: {exc}") from None
    except OSError as exc:  # the connection failed while the call was under way
        raise CallFailed("UNAVAILABLE", f"connection failed: {exc}") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except Exception:  # TLS's close not answered in time, or the peer reset it
            writer.transport.abort()


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    headers: list[tuple[str, str]],
    message: bytes,
) -> bytes:
    conn = h2.connection.H2Connection(
        config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, headers)
    # The message goes as the stream's flow-control window allows.
    outgoing = _Outgoing(conn, stream, message)
    outgoing.send()
    writer.write(conn.data_to_send())
    await writer.drain()
    answer = _Answer()
    first = True
    while not answer.ended:
        data = await reader.read(_READ)
        if not data:
            raise CallFailed("UNAVAILABLE", "the server closed the connection before answering")
        if first:
            first = False
            # An HTTP/2 server speaks first with SETTINGS (frame type 4). h2 would wait for
            # the rest of a "frame" whose length is read from, say, an HTTP/1.1 status line.
            if len(data) >= 4 and data[3] != 4:
                raise CallFailed("INTERNAL", f"not an HTTP/2 server (it sent {data[:16]!r})")
        for event in conn.receive_data(data):
            answer.take(event, stream, conn)
        outgoing.send()
        pending = conn.data_to_send()
        if pending:
            writer.write(pending)
    return answer.message()


class _Outgoing:
    """The request's bytes, sent as flow control allows; the last piece ends the stream."""

    def __init__(self, conn: h2.connection.H2Connection, stream: int, data: bytes) -> None:
        self._conn = conn
        self._stream = stream
        self._rest = memoryview(data)
        self._done = False

    def send(self) -> None:
        conn, rest = self._conn, self._rest
        while not self._done:
            window = conn.local_flow_control_window(self._stream)
            size = min(window, conn.max_outbound_frame_size, len(rest))
            if size <= 0 and rest:
                break  # the window is shut: WINDOW_UPDATE frames will reopen it
            last = size == len(rest)
            conn.send_data(self._stream, rest[:size].tobytes(), end_stream=last)
            rest = rest[size:]
            self._done = last
        self._rest = rest


class _Answer:
    """The answer on one stream, gathered from h2's events."""

    def __init__(self) -> None:
        self.status = 0  # HTTP
        self.fields: dict[str, str] = {}  # headers and trailers
        self.body = bytearray()
        self.ended = False

    def take(self, event: h2.events.Event, stream: int, conn: h2.connection.H2Connection) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            reason = f"the server ended the connection ({event.error_code!r})"
            raise CallFailed("UNAVAILABLE", reason)
        if getattr(event, "stream_id", stream) != stream:
            return
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            for name, value in event.headers or ():
                key, text = _text(name), _text(value)
                if key == ":status":
                    self.status = int(text) if text.isdigit() else 0
                else:
                    self.fields[key] = text
        elif isinstance(event, h2.events.DataReceived):
            self.body += event.data or b""
            conn.acknowledge_received_data(event.flow_controlled_length, stream)
            if len(self.body) > MAX_ANSWER + 5:
                raise CallFailed("RESOURCE_EXHAUSTED", f"answer over {MAX_ANSWER} bytes")
        elif isinstance(event, h2.events.StreamReset):
            code = "UNAVAILABLE" if event.error_code == 7 else "INTERNAL"  # 7: REFUSED_STREAM
            raise CallFailed(code, f"the server reset the call (HTTP/2 error {event.error_code})")
        elif isinstance(event, h2.events.StreamEnded):
            self.ended = True

    def message(self) -> bytes:
        if self.status != 200:
            code = _FROM_HTTP.get(self.status, "UNKNOWN")
            raise CallFailed(code, f"the server answered HTTP {self.status}")
        status = self.fields.get("grpc-status")
        if status is None:
            raise CallFailed("INTERNAL", "the answer carries no grpc-status")
        number = int(status) if status.isdigit() else -1
        if number != 0:
            name = STATUS_NAMES[number] if 0 < number < len(STATUS_NAMES) else "UNKNOWN"
            raise CallFailed(name, unquote(self.fields.get("grpc-message", "")))
        body = bytes(self.body)
        if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            raise CallFailed("INTERNAL", "the answer is not one uncompressed message")
        return body[5:]


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
