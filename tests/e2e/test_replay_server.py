"""The replay LLM server, tested over real loopback sockets.

httpx's sync client plays the part of the OpenAI backend; raw sockets check what httpx
hides: the chunked framing, and how a dropped or stopped response ends.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import pytest

from olliefs.backend import pool
from olliefs.backend.base import BadResponseError, GenerationParams, Message, ResponseSchema
from olliefs.backend.gemini import response_schema as gemini_schema
from olliefs.replay import Entry, EntryToolCall, EntryUsage, ReplayServer, parse_script, run_cli
from olliefs.testing import wait_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0  # generous bound on every blocking step, so a bug fails instead of hanging
USER = [{"role": "user", "content": "hello there"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}

Serve = Callable[..., ReplayServer]


def replay_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("replay-")]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start servers on demand; stop them all after the test and check no thread is left."""
    servers: list[ReplayServer] = []
    # Threads of other tests' servers may still be winding down: only ours are counted.
    before = {t.name for t in threading.enumerate()}

    def start(script: Any = None, **kwargs: Any) -> ReplayServer:
        server = ReplayServer(script, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
    assert [t for t in replay_threads() if t not in before] == []


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as c:
        yield c


def stream(
    client: httpx.Client, server: ReplayServer, body: dict[str, Any], **kwargs: Any
) -> list[Any]:
    """POST a streamed request; the SSE payloads, decoded (``"[DONE]"`` kept as a string)."""
    events: list[Any] = []
    request = {"model": "m", "messages": USER, "stream": True, **body}
    with client.stream("POST", f"{server.url}/chat/completions", json=request, **kwargs) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["transfer-encoding"] == "chunked"
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return events


def deltas(events: list[Any]) -> list[dict[str, Any]]:
    """The counted deltas: every choice chunk but the one with the finish reason."""
    return [
        e["choices"][0]["delta"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["finish_reason"] is None
    ]


def content(events: list[Any]) -> str:
    return "".join(d.get("content", "") for d in deltas(events))


def raw_post(
    server: ReplayServer, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    data = msgspec.json.encode(body)
    sock.sendall(
        b"POST %b HTTP/1.1\r\nHost: replay\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (path.encode(), len(data), data)
    )
    return sock


END_OF_EVENT = b"\n\n\r\n"  # an SSE event's blank line, then the end of its HTTP chunk


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        data = sock.recv(65536)
        assert data, f"connection closed early: {buf!r}"
        buf += data
    return buf


def read_all(sock: socket.socket) -> bytes:
    buf = b""
    while data := sock.recv(65536):
        buf += data
    return buf


def dechunk(body: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body, and whether it ended with the terminating 0 chunk."""
    chunks: list[bytes] = []
    while body:
        size, sep, rest = body.partition(b"\r\n")
        assert sep, body
        n = int(size, 16)
        if n == 0:
            assert rest == b"\r\n"
            return chunks, True
        assert rest[n : n + 2] == b"\r\n"
        chunks.append(rest[:n])
        body = rest[n + 2 :]
    return chunks, False


def test_stream_framing_and_chunk_shape(serve: Serve) -> None:
    server = serve([Entry(reply="Hello, world!")])
    with raw_post(server, {"model": "gpt-x", "messages": USER, "stream": True}) as sock:
        raw = read_all(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    assert headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    assert "content-length" not in headers
    chunks, complete = dechunk(body)
    assert complete
    # one SSE event per HTTP chunk
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"
    events = [msgspec.json.decode(c[6:]) for c in chunks[:-1]]
    first = events[0]
    assert list(first) == ["id", "object", "created", "model", "choices"]
    assert first["id"] == "chatcmpl-1"
    assert first["object"] == "chat.completion.chunk"
    assert isinstance(first["created"], int)
    assert first["model"] == "gpt-x"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "Hell"}, "finish_reason": None}
    ]
    assert [e["choices"][0]["delta"] for e in events[1:-1]] == [
        {"content": "o, w"},
        {"content": "orld"},
        {"content": "!"},
    ]
    assert events[-1]["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert all(e["id"] == "chatcmpl-1" and e["model"] == "gpt-x" for e in events)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_field_variants(
    serve: Serve, client: httpx.Client, field: Literal["reasoning_content", "reasoning"]
) -> None:
    server = serve([Entry(reasoning="think hard", reply="ok", reasoning_field=field, chunk=5)])
    ds = deltas(stream(client, server, {}))
    assert ds == [
        {"role": "assistant", field: "think"},
        {field: " hard"},
        {"content": "ok"},
    ]


def test_tool_call_deltas(serve: Serve, client: httpx.Client) -> None:
    calls = (
        EntryToolCall(id="call_a", name="read", arguments={"path": "/etc/hosts"}),
        EntryToolCall(name="sh", arguments='{"cmd": "ls"}'),
    )
    server = serve([Entry(reply="Let me see.", tool_calls=calls, chunk=5)])
    events = stream(client, server, {})
    ds = deltas(events)
    assert ds[0] == {"role": "assistant", "content": "Let m"}
    tool_deltas = [d["tool_calls"] for d in ds if "tool_calls" in d]
    assert all(len(t) == 1 for t in tool_deltas)
    fragments = [t[0] for t in tool_deltas]
    assert fragments[0] == {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "read", "arguments": ""},
    }
    assert next(f for f in fragments if f["index"] == 1) == {
        "index": 1,
        "id": "call_1_1",  # the default id: request 1, call 1
        "type": "function",
        "function": {"name": "sh", "arguments": ""},
    }
    for index, expected in [(0, {"path": "/etc/hosts"}), (1, {"cmd": "ls"})]:
        parts = [f for f in fragments if f["index"] == index]
        assert all(set(p) == {"index", "function"} for p in parts[1:])
        assert len(parts) > 2  # arguments really come in several fragments
        arguments = "".join(p["function"]["arguments"] for p in parts)
        assert msgspec.json.decode(arguments) == expected
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-1] == "[DONE]"


def test_tool_call_late_ids(serve: Serve, client: httpx.Client) -> None:
    call = EntryToolCall(id="call_late", name="grep", arguments={"pattern": "needle"})
    server = serve([Entry(tool_calls=(call,), late_ids=True, chunk=6)])
    ds = deltas(stream(client, server, {}))
    fragments = [d["tool_calls"][0] for d in ds]
    assert ds[0]["role"] == "assistant"
    assert "id" not in fragments[0] and "name" not in fragments[0]["function"]
    carriers = [i for i, f in enumerate(fragments) if "id" in f]
    assert len(carriers) == 1 and carriers[0] > 0
    assert fragments[carriers[0]]["id"] == "call_late"
    assert fragments[carriers[0]]["function"]["name"] == "grep"
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    assert msgspec.json.decode(arguments) == {"pattern": "needle"}


def test_usage_chunk_only_when_requested(serve: Serve, client: httpx.Client) -> None:
    given = EntryUsage(prompt_tokens=100, completion_tokens=7, cached_tokens=60, cost=0.25)
    server = serve([Entry(reply="abcdefghijkl"), Entry(reply="abcdefghijkl"), Entry(usage=given)])
    assert all(e == "[DONE]" or e["choices"] for e in stream(client, server, {}))
    messages = [{"role": "system", "content": "x" * 20}, {"role": "user", "content": "y" * 20}]
    include = {"messages": messages, "stream_options": {"include_usage": True}}
    events = stream(client, server, include)
    assert events[-1] == "[DONE]"
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    usage_event = events[-2]
    assert usage_event["choices"] == []
    assert usage_event["object"] == "chat.completion.chunk"
    assert usage_event["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert stream(client, server, include)[-2]["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 60},
        "cost": 0.25,
    }


def test_non_stream_answer(serve: Serve, client: httpx.Client) -> None:
    call = EntryToolCall(id="c1", name="ls", arguments={"path": "."})
    server = serve([Entry(reply="Done.", reasoning="hm", tool_calls=(call,))])
    r = client.post(f"{server.url}/chat/completions", json={"model": "m", "messages": USER})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-1"
    assert body["model"] == "m"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Done.",
                "reasoning_content": "hm",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "ls", "arguments": '{"path":"."}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


def test_models_and_paths_without_v1(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="one"), Entry(reply="two")], models=["a", "b"], context_length=4096)
    base = server.url.removesuffix("/v1")
    expected = {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "replay", "context_length": 4096}
            for m in ("a", "b")
        ],
    }
    assert client.get(f"{server.url}/models").json() == expected
    assert client.get(f"{base}/models").json() == expected
    for url in (f"{server.url}/chat/completions", f"{base}/chat/completions"):
        r = client.post(url, json={"model": "a", "messages": USER})
        assert r.status_code == 200
    assert [r["model"] for r in server.requests] == ["a", "a"]
    missing = client.get(f"{server.url}/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"


def test_requests_endpoint(serve: Serve, client: httpx.Client) -> None:
    server = serve()
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    body = {"model": "m", "messages": USER, "tools": tools, "temperature": 0.5}
    client.post(f"{server.url}/chat/completions", json=body)
    stream(client, server, {"max_tokens": 9})
    received = client.get(f"{server.url.removesuffix('/v1')}/_requests").json()
    assert received == server.requests
    assert received[0] == body
    assert received[1] == {"model": "m", "messages": USER, "stream": True, "max_tokens": 9}


def test_error_statuses_and_headers(serve: Serve, client: httpx.Client) -> None:
    server = serve(
        [
            Entry(status=429, retry_after=2, retry_after_ms=1500),
            Entry(status=503, error="overloaded, try later"),
            Entry(status=400, error="prompt too long", error_code="context_length_exceeded"),
            Entry(status=502, body="<html>bad gateway</html>"),
            Entry(reply="recovered"),
        ]
    )
    url = f"{server.url}/chat/completions"
    request = {"model": "m", "messages": USER, "stream": True}

    r = client.post(url, json=request)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert r.headers["retry-after-ms"] == "1500"
    assert r.json() == {
        "error": {
            "message": "429 Too Many Requests",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    r = client.post(url, json=request)
    assert r.status_code == 503
    assert "retry-after" not in r.headers
    assert r.json()["error"] == {
        "message": "overloaded, try later",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    r = client.post(url, json=request)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post(url, json=request)
    assert (r.status_code, r.text) == (502, "<html>bad gateway</html>")
    # error answers keep the connection usable
    assert content(stream(client, server, {})) == "recovered"


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "a", "tool_call_id": "c1", "name": "ls"},
            ],
            "messages[2].name: Extra inputs are not permitted",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "ls", "arguments": '{"a'}}],
                }
            ],
            "messages[1].tool_calls[0].function.arguments: not valid JSON",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "ls", "arguments": "[]"}}],
                }
            ],
            "messages[1].tool_calls[0].function.arguments: must be a JSON object",
        ),
    ],
    ids=["name on a tool message", "arguments not JSON", "arguments not an object"],
)
def test_a_strict_server_refuses_what_the_api_does_not_define(
    serve: Serve, client: httpx.Client, messages: list[dict[str, Any]], why: str
) -> None:
    """As strict OpenAI-compatible servers do: a 400 that names the field; the request
    is recorded and the script entry is left for the next one."""
    server = serve([Entry(reply="next")])
    body = {"model": "m", "messages": [*USER, *messages], "stream": True}
    r = client.post(f"{server.url}/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(why), r.text
    assert server.requests == [body]
    assert content(stream(client, server, {})) == "next"


def test_drop_after_raw_socket(serve: Serve) -> None:
    server = serve([Entry(reply="a" * 40, chunk=4, drop_after=3)])
    with raw_post(server, {"model": "m", "messages": USER, "stream": True}) as sock:
        raw = read_all(sock)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    chunks, complete = dechunk(body)
    assert not complete
    assert len(chunks) == 3
    assert b"[DONE]" not in body
    assert b'"finish_reason":null' in chunks[-1]


def test_drop_after_seen_by_httpx(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="a" * 40, drop_after=2), Entry(drop_after=0)])
    request = {"model": "m", "messages": USER, "stream": True}
    seen: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", f"{server.url}/chat/completions", json=request) as r,
    ):
        seen.extend(line for line in r.iter_lines() if line)
    assert len(seen) == 2
    # non-streamed: dropped without an answer
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(f"{server.url}/chat/completions", json={"model": "m", "messages": USER})


def stop_promptly(server: ReplayServer) -> None:
    """stop() in a thread, bounded: a stop that blocks fails the test instead of hanging it."""
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive(), "stop() blocked"
    assert replay_threads() == []


def test_hang_then_stop(serve: Serve) -> None:
    server = serve([Entry(reply="never finished", hang=True, hang_after=1)])
    with raw_post(server, {"model": "m", "messages": USER, "stream": True}) as sock:
        got = read_until(sock, END_OF_EVENT)  # the headers, then one whole chunk
        assert b"data: " in got
        stop_promptly(server)
        rest = read_all(sock)  # the connection ends
    assert b"[DONE]" not in got + rest
    assert not dechunk(got.partition(b"\r\n\r\n")[2] + rest)[1]


def test_hang_ends_when_the_client_goes_away(serve: Serve) -> None:
    server = serve([Entry(hang=True)])
    with raw_post(server, {"model": "m", "messages": USER, "stream": True}) as sock:
        assert read_until(sock, b"\r\n\r\n").endswith(b"\r\n\r\n")  # headers only
    deadline = time.monotonic() + TIMEOUT
    for thread in threading.enumerate():
        if thread.name.startswith("replay-conn"):
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), "the hanging handler outlived its client"
    with httpx.Client(timeout=TIMEOUT) as client:
        assert client.get(f"{server.url}/models").status_code == 200


def test_stop_interrupts_delays(serve: Serve) -> None:
    server = serve([Entry(reply="slow reply", chunk=1, delay=3600), Entry(first_delay=3600)])
    slow = raw_post(server, {"model": "m", "messages": USER, "stream": True})
    late = None
    try:
        read_until(slow, END_OF_EVENT)  # headers and the first delta
        late = raw_post(server, {"model": "m", "messages": USER})
        server.wait_recorded(lambda got: len(got) >= 2, TIMEOUT)  # the second: first_delay
        stop_promptly(server)
        assert b"[DONE]" not in read_all(slow)
        assert read_all(late) == b""  # no response at all
    finally:
        slow.close()
        if late is not None:
            late.close()


def test_garbage(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(garbage="{not json"), Entry(garbage="<html>oops")])
    request = {"model": "m", "messages": USER, "stream": True}
    with client.stream("POST", f"{server.url}/chat/completions", json=request) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines == ["data: {not json", "data: [DONE]"]
    r = client.post(f"{server.url}/chat/completions", json={"model": "m", "messages": USER})
    assert (r.status_code, r.text) == (200, "<html>oops")


def test_echo_mode_after_script(serve: Serve, client: httpx.Client) -> None:
    server = serve('{"reply": "scripted"}\n')
    for expected in ("scripted", "echo: hello there"):
        assert content(stream(client, server, {})) == expected
    parts = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "in "}, {"type": "text", "text": "parts"}],
        },
    ]
    r = client.post(f"{server.url}/chat/completions", json={"model": "m", "messages": parts})
    assert r.json()["choices"][0]["message"]["content"] == "echo: in parts"


def test_then_error(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="only one")], then="error")
    assert client.post(f"{server.url}/chat/completions", json={"messages": USER}).status_code == 200
    r = client.post(f"{server.url}/chat/completions", json={"messages": USER, "stream": True})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "replay script exhausted"
    with pytest.raises(ValueError, match="then"):
        ReplayServer(then="crash")


def test_key_check(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="secret reply")], key="sk-test")
    url = f"{server.url}/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
        r = client.post(url, json={"messages": USER}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert client.get(f"{server.url}/models", headers=headers).status_code == 401
    good = {"Authorization": "Bearer sk-test"}
    assert client.get(f"{server.url}/models", headers=good).status_code == 200
    # the refused requests did not consume the entry
    r = client.post(url, json={"messages": USER}, headers=good)
    assert r.json()["choices"][0]["message"]["content"] == "secret reply"


def test_parse_script() -> None:
    text = '# a comment\n\n{"reply": "hi", "chunk": 2}\n  # indented comment\n{"status": 429}\n'
    assert parse_script(text) == [Entry(reply="hi", chunk=2), Entry(status=429)]
    with pytest.raises(ValueError, match=r"^line 3: "):
        parse_script('{"reply": "a"}\n\n{"reply": \n')
    with pytest.raises(ValueError, match=r"^line 2: .*unknown field `replies`"):
        parse_script('{"reply": "a"}\n{"replies": "b"}\n')
    with pytest.raises(ValueError, match=r"^line 1: .*unknown field `nme`"):
        parse_script('{"tool_calls": [{"nme": "x"}]}')
    with pytest.raises(ValueError, match=r"^line 1: "):
        parse_script('{"chunk": 0}')
    with pytest.raises(ValueError, match=r"^line 1: "):
        parse_script('{"reply": 3}')


def test_script_file(serve: Serve, client: httpx.Client, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reply": "x"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2"):
        ReplayServer(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"reply": "from a file"}\n')
    server = serve(good)
    r = client.post(f"{server.url}/chat/completions", json={"messages": USER})
    assert r.json()["choices"][0]["message"]["content"] == "from a file"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com", ""])
def test_non_loopback_host_refused(host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        ReplayServer(host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost"])
def test_loopback_hosts_accepted(serve: Serve, client: httpx.Client, host: str) -> None:
    server = serve(host=host)
    assert client.get(f"{server.url}/models").status_code == 200


def test_keep_alive(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="first"), Entry(status=429)])
    url = f"{server.url}/chat/completions"
    request = {"model": "m", "messages": USER, "stream": True}
    addresses = []
    with client.stream("POST", url, json=request) as r:
        addresses.append(r.extensions["network_stream"].get_extra_info("client_addr"))
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    for r in (
        client.post(url, json=request),
        client.post(url, json={"messages": USER}),
        client.get(f"{server.url}/models"),
    ):
        assert r.status_code in (200, 429)
        addresses.append(r.extensions["network_stream"].get_extra_info("client_addr"))
    assert len(set(addresses)) == 1, addresses
    stop_promptly(server)  # while the client still holds the idle connection


def test_add_at_runtime(serve: Serve, client: httpx.Client) -> None:
    server = serve()
    server.add([Entry(reply="added one"), Entry(reply="added two")])
    for expected in ("added one", "added two", "echo: hello there"):
        r = client.post(f"{server.url}/chat/completions", json={"messages": USER})
        assert r.json()["choices"][0]["message"]["content"] == expected


def test_on_send(serve: Serve, client: httpx.Client) -> None:
    sent: list[tuple[str, float]] = []
    server = serve(
        [Entry(reasoning="not content", reply="token by token", chunk=3)],
        on_send=lambda text, t: sent.append((text, t)),
    )
    stream(client, server, {})
    assert "".join(text for text, _ in sent) == "token by token"
    times = [t for _, t in sent]
    assert times == sorted(times)


def test_url_and_context_manager() -> None:
    with ReplayServer() as server:
        assert server.url == f"http://127.0.0.1:{server.port}/v1"
    assert replay_threads() == []
    with pytest.raises(RuntimeError):
        _ = server.url


CLI = "import sys; from olliefs.replay import run_cli; sys.exit(run_cli())"


def test_cli_subprocess(tmp_path: Path) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text('{"reply": "from the cli"}\n')
    port_file = tmp_path / "port"
    argv = [sys.executable, "-c", CLI, "--script", str(script), "--port-file", str(port_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [*argv, "--model", "one", "--model", "two"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            wait_until(
                lambda: port_file.exists() or proc.poll() is not None,
                "a port file",
                TIMEOUT,
                files=[port_file],
                exits=[proc.pid],
            )
            assert proc.poll() is None, "the server exited early"
            port = int(port_file.read_text())
            with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=TIMEOUT) as c:
                assert [m["id"] for m in c.get("/models").json()["data"]] == ["one", "two"]
                r = c.post("/chat/completions", json={"model": "one", "messages": USER})
                assert r.json()["choices"][0]["message"]["content"] == "from the cli"
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert out == f"replay server listening on http://127.0.0.1:{port}/v1\n"
    assert not port_file.exists()


def test_cli_startup_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reply": "x"}\n{not json\n')
    occupied = tmp_path / "occupied"  # a directory where the port file should go
    occupied.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases = [
            (["--script", str(bad)], "line 2"),
            (["--host", "0.0.0.0"], "loopback"),
            (["--port", str(taken.getsockname()[1])], "ollie replay-server:"),
            (["--port-file", str(occupied)], "Is a directory"),
        ]
        for argv, message in cases:
            assert run_cli(argv) == 2
            out, err = capsys.readouterr()
            assert out == ""
            assert message in err
            assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "occupied"]
    assert occupied.is_dir()
    assert replay_threads() == []


# --- every wire format ----------------------------------------------------------------------

KEY = "sk-replay-test"


def post_raw(server: ReplayServer, path: str, body: dict[str, Any], headers: str = "") -> bytes:
    """A request over a raw socket; the response body, de-chunked and checked complete."""
    data = msgspec.json.encode(body)
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(
            b"POST %b HTTP/1.1\r\nHost: replay\r\nContent-Type: application/json\r\n%b"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b"
            % (path.encode(), headers.encode(), len(data), data)
        )
        raw = read_all(sock)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    chunks, complete = dechunk(rest)
    assert complete
    return b"".join(chunks)


def test_anthropic_wire(serve: Serve, client: httpx.Client) -> None:
    server = serve(
        [Entry(reasoning="hm", reply="Hi", tool_calls=(EntryToolCall(name="ls", id="t1"),))],
        key=KEY,
    )
    body = {"model": "claude", "max_tokens": 10, "stream": True, "messages": USER}
    url = f"{server.base_url}/v1/messages"
    r = client.post(url, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
    r = client.post(url, json=body, headers={"anthropic-version": "2023-06-01"})
    assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")
    auth = f"x-api-key: {KEY}\r\nanthropic-version: 2023-06-01\r\n"
    events = post_raw(server, "/v1/messages", body, auth).split(b"\n\n")[:-1]
    kinds = [e.split(b"\n")[0].removeprefix(b"event: ").decode() for e in events]
    assert kinds == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta"],
        "content_block_stop",  # thinking, then its signature
        *["content_block_start", "content_block_delta", "content_block_stop"],  # text
        *["content_block_start", "content_block_delta", "content_block_stop"],  # tool_use
        "message_delta",
        "message_stop",
    ]
    data = [msgspec.json.decode(e.split(b"\ndata: ")[1]) for e in events]
    assert data[3]["delta"] == {"type": "signature_delta", "signature": "sig-1"}
    assert data[-2]["delta"]["stop_reason"] == "tool_use"
    models = client.get(
        f"{server.base_url}/v1/models",
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    ).json()
    assert models["data"][0]["id"] == "replay" and models["has_more"] is False


def test_ollama_wire(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="Hi there", chunk=3)], context_length=8192)
    body = {"model": "replay", "messages": USER}  # Ollama streams unless told not to
    lines = post_raw(server, "/api/chat", body).split(b"\n")
    assert lines[-1] == b""
    docs = [msgspec.json.decode(line) for line in lines[:-1]]
    assert "".join(d["message"]["content"] for d in docs) == "Hi there"
    assert [d["done"] for d in docs] == [False, False, False, True]
    assert docs[-1]["done_reason"] == "stop" and docs[-1]["eval_count"] >= 1
    assert client.get(f"{server.base_url}/api/tags").json()["models"][0]["name"] == "replay"
    show = client.post(f"{server.base_url}/api/show", json={"model": "replay"}).json()
    assert show["model_info"]["replay.context_length"] == 8192
    assert client.post(f"{server.base_url}/api/show", json={"model": "x"}).status_code == 404


def test_gemini_wire(serve: Serve, client: httpx.Client) -> None:
    server = serve([Entry(reply="Hi", status=429, retry_delay="9s")], key=KEY)
    path = "/v1beta/models/replay:streamGenerateContent"
    r = client.post(f"{server.base_url}{path}", json={"contents": []}, params={"key": KEY})
    assert r.status_code == 400  # only alt=sse is served
    r = client.post(f"{server.base_url}{path}?alt=sse", json={"contents": []})
    assert (r.status_code, r.json()["error"]["status"]) == (401, "UNAUTHENTICATED")
    r = client.post(f"{server.base_url}{path}?alt=sse&key={KEY}", json={"contents": []})
    assert r.status_code == 429
    assert r.json()["error"]["details"][0]["retryDelay"] == "9s"
    body = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}
    events = post_raw(server, f"{path}?alt=sse", body, f"x-goog-api-key: {KEY}\r\n")
    assert events.endswith(b"\r\n\r\n")
    docs = [msgspec.json.decode(e[6:]) for e in events.split(b"\r\n\r\n")[:-1]]
    text = "".join(p.get("text", "") for d in docs for p in d["candidates"][0]["content"]["parts"])
    assert text == "echo: hello"
    assert docs[-1]["candidates"][0]["finishReason"] == "STOP"
    listed = client.get(f"{server.base_url}/v1beta/models", headers={"x-goog-api-key": KEY})
    assert listed.json()["models"][0]["name"] == "models/replay"


def test_copilot_token_exchange_and_editor_headers(serve: Serve, client: httpx.Client) -> None:
    server = serve(key=KEY)
    url = f"{server.base_url}/copilot_internal/v2/token"
    assert client.get(url, headers={"Authorization": "token wrong"}).status_code == 401
    token = client.get(url, headers={"Authorization": f"token {KEY}"}).json()
    assert token["endpoints"]["api"] == server.base_url and token["refresh_in"] > 0
    chat = f"{token['endpoints']['api']}/chat/completions"
    body = {"model": "m", "messages": USER, "stream": True}
    bearer = {"Authorization": f"Bearer {token['token']}"}
    r = client.post(chat, json=body, headers=bearer)
    assert r.status_code == 400 and "Editor-Version" in r.json()["error"]["message"]
    editor = {**bearer, "Editor-Version": "vscode/1", "Copilot-Integration-Id": "vscode-chat"}
    assert client.post(chat, json=body, headers=editor).status_code == 200
    models = client.get(f"{server.base_url}/models", headers=editor).json()["data"]
    assert models[0]["capabilities"]["limits"]["max_prompt_tokens"] == 128000
    assert server.recorded[-1].headers["copilot-integration-id"] == "vscode-chat"


def test_kiro_wire(serve: Serve, client: httpx.Client) -> None:
    from olliefs.backend.kiro import EventStreamDecoder

    server = serve([Entry(reply="Hey", tool_calls=(EntryToolCall(name="ls", id="u1"),))], key=KEY)
    refreshed = client.post(f"{server.base_url}/refreshToken", json={"refreshToken": KEY}).json()
    body = {
        "conversationState": {
            "currentMessage": {"userInputMessage": {"content": "hi", "modelId": "claude"}}
        }
    }
    auth = f"Authorization: Bearer {refreshed['accessToken']}\r\n"
    frames = EventStreamDecoder().feed(post_raw(server, "/generateAssistantResponse", body, auth))
    kinds = [f.headers[":event-type"] for f in frames]
    assert kinds == [
        "messageMetadataEvent",
        "assistantResponseEvent",
        "toolUseEvent",
        "toolUseEvent",
        "meteringEvent",
    ]
    assert msgspec.json.decode(frames[3].payload) == {"toolUseId": "u1", "name": "ls", "stop": True}
    r = client.post(f"{server.base_url}/generateAssistantResponse", json=body)
    assert r.status_code == 403


def test_raw_bytes_are_replayed_exactly(serve: Serve) -> None:
    raw = b"data: one\n\ndata: two\r\n\r\n: comment\n\ndata: [DONE]"
    server = serve([Entry(raw=raw, raw_chunk=7), Entry(raw=raw, raw_chunk=5, drop_after=12)])
    with raw_post(server, {"model": "m", "messages": USER, "stream": True}) as sock:
        chunks, complete = dechunk(read_all(sock).partition(b"\r\n\r\n")[2])
    assert complete and b"".join(chunks) == raw
    assert [len(c) for c in chunks] == [7] * (len(raw) // 7) + [len(raw) % 7]
    with raw_post(server, {"model": "m", "messages": USER, "stream": True}) as sock:
        chunks, complete = dechunk(read_all(sock).partition(b"\r\n\r\n")[2])
    assert not complete and b"".join(chunks) == raw[:12]


@pytest.mark.parametrize(
    ("path", "body", "marker"),
    [
        ("/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}, b'"code":502'),
        ("/api/chat", {"model": "m", "messages": USER}, b'{"error":"overloaded"}\n'),
    ],
)
def test_errors_inside_a_stream(
    serve: Serve, path: str, body: dict[str, Any], marker: bytes
) -> None:
    server = serve(
        [Entry(reply="abcdefgh", status=502, error="overloaded", in_stream=True, drop_after=1)]
    )
    data = post_raw(server, path, body)
    last = data.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    assert marker.strip() in last and data.endswith(b"\n")
    assert b"[DONE]" not in data and b'"done":true' not in data and b"efgh" not in data


def test_keepalives_and_a_last_event_without_blank_line(serve: Serve) -> None:
    server = serve([Entry(reply="abcdefgh", keepalive=True, no_final_newline=True)])
    data = post_raw(
        server, "/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}
    )
    assert data.count(b": keep-alive\n\n") == 1  # between the two deltas
    assert data.endswith(b"data: [DONE]")


def test_cli_env_flag(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    argv = [sys.executable, "-c", CLI, "--env", "--key", "k1", "--port-file", str(port_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        settings = dict(proc.stdout.readline().strip().split("=", 1) for _ in range(14))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=TIMEOUT)
    base = first.strip().removeprefix("replay server listening on ").removesuffix("/v1")
    assert settings["OLLIE_ANTHROPIC_URL"] == base
    assert settings["OLLIE_OPENAI_URL"] == f"{base}/v1"
    assert settings["OLLIE_COPILOT_TOKEN_URL"] == f"{base}/copilot_internal/v2/token"
    assert settings["OLLIE_KIRO_KEY"] == "k1"
    assert proc.returncode == 0


SCHEMA = {
    "type": "object",
    "properties": {"state": {"type": "string"}},
    "required": ["state"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("wire", ["openai", "copilot", "anthropic", "ollama", "gemini", "kiro"])
async def test_the_schema_a_request_asks_for_is_recorded_and_can_be_refused(
    serve: Serve, wire: str
) -> None:
    """Each wire's structured output, sent by our own backend, is seen as the schema it
    is; ``refuse_schema`` answers it 400 and keeps the entry for the request without."""
    server = serve([Entry(refuse_schema=True, reply='{"state": "s"}')], key="sk-replay-test")
    backend = pool.make_backend(wire, server.settings())
    asked = GenerationParams(response_schema=ResponseSchema("answer", SCHEMA))

    async def ask(params: GenerationParams) -> str:
        async with backend.stream("replay", [Message("user", "hi")], [], params) as events:
            return "".join([e.text async for e in events if e.kind == "content"])

    try:
        if wire == "kiro":  # no structured output there: nothing to refuse
            assert await ask(asked) == '{"state": "s"}'
            assert server.recorded[-1].schema is None
            return
        with pytest.raises(BadResponseError, match="HTTP 400: structured output is not"):
            await ask(asked)
        seen = server.recorded[-1].schema
        assert seen == (gemini_schema(SCHEMA) if wire == "gemini" else SCHEMA)
        assert await ask(GenerationParams()) == '{"state": "s"}'
        assert server.recorded[-1].schema is None
        assert await ask(GenerationParams()) == "echo: hi"  # the entry was taken
    finally:
        await backend.aclose()
