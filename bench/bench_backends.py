"""Backend parsers: throughput on a 10 MB recorded stream, and wire-to-event latency.

Run: ``.venv/bin/python bench/bench_backends.py`` (needs the ``test`` extra for the SDKs).
Prints a table; it asserts nothing. The target (issue 9) is that parsing is never the
bottleneck: over 50 MB/s for every provider.

(a) throughput: for each wire format a ~10 MB body is rendered by the replay server's own
    wire module (a long reply in 8-character deltas, thinking where the wire has it, tool
    calls, usage, the terminator), cut into 64 KiB reads as a socket would deliver them,
    and parsed whole by our parser (``feed`` per read). Reference, measured in the same
    run on the same bytes: the official SDK's own framing plus ``json.loads`` of every
    payload (openai's and anthropic's ``SSEDecoder``, google-genai's SSE line decoder,
    ollama's line-by-line ``json.loads``, botocore's ``EventStreamBuffer``), without the
    SDKs' pydantic models, which would only slow the reference down.
    Throughput is bytes per second of CPU time (best of 3): the machines this runs on are
    shared, and wall time measures the neighbours.
(b) first event: the replay server streams a short reply over loopback to each backend;
    a wrapper around httpx's transport notes when the response's first body bytes, and
    the bytes holding the first delta, come off the socket; the backend's first
    ``content`` event is timed against both (median of 200 runs). Reference, same run:
    a bare httpx client given the same bytes through the same wrapper (OpenAI wire).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import AsyncIterator, Callable
from functools import partial

import httpx
import trio

from olliefs.backend.anthropic import AnthropicBackend, AnthropicParser
from olliefs.backend.base import Backend, GenerationParams, Message
from olliefs.backend.copilot import CopilotBackend
from olliefs.backend.gemini import GeminiBackend, GeminiParser
from olliefs.backend.kiro import KiroBackend, KiroParser
from olliefs.backend.ollama import OllamaBackend, OllamaParser
from olliefs.backend.openai import OpenAIBackend, OpenAIParser
from olliefs.backend.stream import Parser, parse_all
from olliefs.replay import Entry, EntryToolCall, ReplayServer
from olliefs.replay.server import WIRES
from olliefs.replay.wire import Answer

SIZE = 10 * 1024 * 1024
READ = 64 * 1024
RUNS = 200
KEY = "sk-bench"
WORDS = "the quick brown fox jumps over the lazy dog while parsers keep up; "


# ---- (a) throughput ------------------------------------------------------------------------


def body(wire_name: str) -> bytes:
    """About SIZE bytes of one wire format: many small deltas, then the stream's end."""
    wire = WIRES[wire_name]
    entry = Entry(
        reasoning=WORDS * 20,
        reply=WORDS * 200,
        tool_calls=(
            EntryToolCall(name="file_read", arguments={"path": "a/b/c.txt"}, id="t1"),
            EntryToolCall(name="file_grep", arguments={"pattern": "x" * 40}, id="t2"),
        ),
        chunk=8,
    )
    answer = Answer(1, entry, "bench-model", 4000)
    plan = wire.stream(answer, {"stream_options": {"include_usage": True}})
    frames = [f.data for f in plan.frames]
    head = frames[: max(1, len(frames) // 50)]  # message_start and the like come once
    middle = b"".join(frames[len(head) :])
    tail = b"".join(f.data for f in plan.tail)
    repeat = max(1, (SIZE - len(tail)) // len(middle))
    return b"".join(head) + middle * repeat + tail


def reads(data: bytes) -> list[bytes]:
    return [data[i : i + READ] for i in range(0, len(data), READ)]


def sdk_reference(wire: str) -> Callable[[list[bytes]], int]:
    """The official SDK's framing plus json.loads of every payload; returns the count."""
    if wire in ("openai", "anthropic"):
        module = __import__(f"{wire}._streaming", fromlist=["SSEDecoder"])

        def sse(chunks: list[bytes]) -> int:
            n = 0
            for event in module.SSEDecoder().iter_bytes(iter(chunks)):
                if event.data and event.data != "[DONE]":
                    json.loads(event.data)
                    n += 1
            return n

        return sse
    if wire == "gemini":
        from google.genai._api_client import _iter_sse_lines

        def gemini(chunks: list[bytes]) -> int:
            n = 0
            for line in _iter_sse_lines(chunks):
                if line.startswith("data: "):
                    json.loads(line[6:])
                    n += 1
            return n

        return gemini
    if wire == "ollama":

        def ollama(chunks: list[bytes]) -> int:
            # the SDK: httpx's iter_lines over the body, json.loads per line
            n = 0
            for line in httpx.Response(200, content=b"".join(chunks)).iter_lines():
                if line:
                    json.loads(line)
                    n += 1
            return n

        return ollama
    from botocore.eventstream import EventStreamBuffer

    def kiro(chunks: list[bytes]) -> int:
        buffer, n = EventStreamBuffer(), 0
        for chunk in chunks:
            buffer.add_data(chunk)
            for message in buffer:
                json.loads(message.payload)
                n += 1
        return n

    return kiro


PARSERS: dict[str, Callable[[], Parser]] = {
    "openai": OpenAIParser,
    "anthropic": AnthropicParser,
    "ollama": OllamaParser,
    "gemini": GeminiParser,
    "kiro": KiroParser,
}


def best_of(n: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(n):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def parse_all_new(make: Callable[[], Parser], chunks: list[bytes]) -> object:
    return parse_all(make(), chunks)


def throughput() -> dict[str, tuple[float, float, int]]:
    out = {}
    for wire, make in PARSERS.items():
        data = body(wire)
        chunks = reads(data)
        events = parse_all(make(), chunks)
        assert events[-1].kind == "done", wire
        reference = sdk_reference(wire)
        ours = best_of(3, partial(parse_all_new, make, chunks))
        theirs = best_of(3, partial(reference, chunks))
        mb = len(data) / 1e6
        out[wire] = (mb / ours, mb / theirs, len(events))
    return out


# ---- (b) first event -----------------------------------------------------------------------


class Arrivals:
    """When httpx delivered body bytes to its reader (wraps the real transport)."""

    def __init__(self) -> None:
        self.first_byte: float | None = None
        self.first_delta: float | None = None
        self.marker = b""
        self.transport = _Timing(self)

    def reset(self, marker: str) -> None:
        self.first_byte = self.first_delta = None
        self.marker = marker.encode()


class _Timing(httpx.AsyncHTTPTransport):
    def __init__(self, arrivals: Arrivals) -> None:
        super().__init__()
        self.arrivals = arrivals

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        inner: httpx.AsyncByteStream = response.stream
        arrivals = self.arrivals

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for chunk in inner:
                    now = time.monotonic()
                    if arrivals.first_byte is None:
                        arrivals.first_byte = now
                    if arrivals.first_delta is None and arrivals.marker in chunk:
                        arrivals.first_delta = now
                    yield chunk

            async def aclose(self) -> None:
                await inner.aclose()

        response.stream = Stream()
        return response


def backend(name: str, server: ReplayServer, transport: httpx.AsyncBaseTransport) -> Backend:
    base = server.base_url
    if name == "openai":
        return OpenAIBackend("openai", server.url, KEY, transport=transport)
    if name == "anthropic":
        return AnthropicBackend("anthropic", base, KEY, transport=transport)
    if name == "ollama":
        return OllamaBackend("ollama", base, transport=transport)
    if name == "gemini":
        return GeminiBackend("gemini", base, KEY, transport=transport)
    if name == "copilot":
        token_url = f"{base}/copilot_internal/v2/token"
        return CopilotBackend(
            "copilot", KEY, api_url=base, token_url=token_url, transport=transport
        )
    return KiroBackend("kiro", base, KEY, transport=transport)


def script(i: int) -> tuple[str, Entry]:
    marker = f"Z{i:05d}Z"
    return marker, Entry(reply=marker + " and the rest of it", chunk=7)


async def first_events(name: str) -> tuple[float, float]:
    """Medians: (bytes holding the first delta -> event, first body byte -> event)."""
    server = ReplayServer(key=KEY).start()
    from_delta, from_first = [], []
    try:
        arrivals = Arrivals()
        b = backend(name, server, arrivals.transport)
        for i in range(RUNS):
            marker, entry = script(i)
            arrivals.reset(marker)
            server.add([entry])
            async with b.stream("m", [Message("user", "hi")], [], GenerationParams()) as events:
                async for event in events:
                    if event.kind == "content":
                        now = time.monotonic()
                        assert arrivals.first_delta is not None and arrivals.first_byte
                        from_delta.append(now - arrivals.first_delta)
                        from_first.append(now - arrivals.first_byte)
                        break
        await b.aclose()
    finally:
        server.stop()
    return statistics.median(from_delta), statistics.median(from_first)


async def bare_httpx() -> float:
    """Reference: a bare httpx reader of the same bytes, through the same wrapper."""
    server = ReplayServer(key=KEY).start()
    seen = []
    try:
        arrivals = Arrivals()
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(transport=arrivals.transport, headers=headers) as client:
            for i in range(RUNS):
                marker, entry = script(i)
                arrivals.reset(marker)
                server.add([entry])
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                }
                url = f"{server.url}/chat/completions"
                async with client.stream("POST", url, json=body) as response:
                    async for chunk in response.aiter_bytes():
                        if marker.encode() in chunk:
                            assert arrivals.first_delta is not None
                            seen.append(time.monotonic() - arrivals.first_delta)
                            break
    finally:
        server.stop()
    return statistics.median(seen)


def main() -> None:
    mb = SIZE // (1024 * 1024)
    print(f"(a) parser throughput, {mb} MB recorded stream, {READ // 1024} KiB reads, CPU time")
    print(f"{'wire':<10} {'events':>8} {'ours MB/s':>10} {'SDK MB/s':>9} {'ours/SDK':>9}")
    for wire, (ours, theirs, events) in throughput().items():
        print(f"{wire:<10} {events:>8} {ours:>10.1f} {theirs:>9.1f} {ours / theirs:>9.2f}")
    print("(copilot uses the openai parser; target: over 50 MB/s for every wire)")
    print()
    print(f"(b) first assistant event over loopback, median of {RUNS} runs")
    print(f"{'backend':<10} {'delta bytes -> event':>21} {'first byte -> event':>20}")
    for name in ("openai", "anthropic", "ollama", "gemini", "copilot", "kiro"):
        from_delta, from_first = trio.run(first_events, name)
        print(f"{name:<10} {from_delta * 1e6:>18.0f} us {from_first * 1e6:>17.0f} us")
    reference = trio.run(bare_httpx)
    print(f"{'reference':<10} {reference * 1e6:>18.0f} us   (bare httpx reader, same bytes)")


if __name__ == "__main__":
    main()
