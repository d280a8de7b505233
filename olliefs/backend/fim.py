"""Fill in the middle: the text a model would insert between a prefix and a suffix.

What an editor's code completion asks (ollie(5), COMPLETION): given the text before the
cursor and the text after it, the text to insert, and nothing else. Each provider is
asked in its own way, on the backend objects of the daemon's pool (their connections,
keys, tokens and error mapping), without touching the provider modules:

=========================  ==========================================================
backend                    request
=========================  ==========================================================
ollama                     ``POST /api/generate`` with ``prompt`` and ``suffix``: the
                           model's own fill-in-the-middle template
openai (any compatible)    ``POST /v1/completions`` with ``prompt`` and ``suffix``
anthropic, gemini,         a chat request built for insertion (``CHAT_SYSTEM``), through
copilot, kiro              the backend's ``stream``
=========================  ==========================================================

A server that has no such endpoint, or a model that cannot fill in the middle, gets the
chat request instead: ``/v1/completions`` answered 404, 405 or 501 (a server without it;
OpenAI answers 404 for a chat model), or 400/422 saying it has no ``suffix``; Ollama's
400 "does not support insert". The caller remembers that (``chat_only``), so the next
completion for the same backend and model goes straight to chat.

Ollama renders its template's fill-in-the-middle form only when ``suffix`` is not empty
(else the prompt becomes a chat message, and the model answers it as one): an empty
suffix is sent as a newline, which changes nothing of what comes before the cursor.

The answer. A native completion is the inserted text as it is, but for a leading
``<think>`` block and the whole lines of the suffix it repeats at its end (a server that
ignores ``suffix`` writes them out again). A chat model's answer is read with
``insertion``: what it put between ``<insert>`` and ``</insert>`` (it is asked to), else
the first fenced code block, else the whole answer; a ``<think>`` block is dropped; so
are the part of the cursor's line it repeats at the start and the lines of the suffix
it repeats at the end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import msgspec

from olliefs.backend.base import GenerationParams, Message, ProviderBackend
from olliefs.backend.ollama import OllamaBackend
from olliefs.backend.openai import OpenAIBackend
from olliefs.backend.stream import HTTPBackend, provider_message

_T = TypeVar("_T")
MAX_ERROR_BODY = 64 * 1024
TEMPERATURE = 0.2  # completions should be the likely text, not a creative one
CURSOR = "<|CURSOR|>"

CHAT_SYSTEM = (
    "You are a code completion engine inside an editor. The user sends the text of a"
    " file, between <file> and </file>, with the marker " + CURSOR + " where the cursor"
    " is. Answer with the text to insert at the cursor, so that the text before the"
    " marker, your text and the text after it read as one file. Write only the inserted"
    " text, between <insert> and </insert>: no explanation, no Markdown fences, and do"
    " not repeat the text around the cursor. If nothing should be inserted, answer"
    " <insert></insert>."
)


@dataclass(frozen=True)
class Request:
    """One completion: the text before and after the cursor, the file's name (a hint of
    its language; may be empty) and the most tokens to generate."""

    prefix: str
    suffix: str
    file: str = ""
    max_tokens: int = 256


class _Generated(msgspec.Struct, gc=False):
    response: str = ""


class _TextChoice(msgspec.Struct, gc=False):
    text: str = ""


class _Completion(msgspec.Struct, gc=False):
    choices: list[_TextChoice] = []


_GENERATED = msgspec.json.Decoder(_Generated)
_COMPLETION = msgspec.json.Decoder(_Completion)


def kind(backend: ProviderBackend) -> str:
    """``ollama``, ``openai`` (a native fill-in-the-middle request) or ``chat``."""
    if isinstance(backend, OllamaBackend):
        return "ollama"
    if type(backend) is OpenAIBackend:  # Copilot's subclass has no completions endpoint
        return "openai"
    return "chat"


async def complete(
    backend: ProviderBackend, model: str, request: Request, chat_only: set[tuple[str, str]]
) -> str:
    """The text to insert; BackendError when the provider fails. ``chat_only`` holds
    the (backend, model) pairs known to need the chat request; this adds to it."""
    how = kind(backend)
    if how != "chat" and (backend.name, model) not in chat_only:
        native = await (_ollama if how == "ollama" else _openai)(backend, model, request)
        if native is not None:  # a server may ignore the suffix and write it out again
            return _without_suffix(strip_think(native), request.suffix)
        chat_only.add((backend.name, model))
    return await _chat(backend, model, request)


# ---- native requests -----------------------------------------------------------------------


async def _post(
    backend: HTTPBackend, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """POST ``body`` as JSON with the backend's client; typed errors for the network."""
    with backend._errors():
        return await backend._client.post(
            url,
            content=msgspec.json.encode(body),
            headers={"content-type": "application/json", **(headers or {})},
        )


def _words(response: httpx.Response) -> str:
    return provider_message(response.content[:MAX_ERROR_BODY].decode("utf-8", "replace")).lower()


async def _ollama(backend: ProviderBackend, model: str, request: Request) -> str | None:
    assert isinstance(backend, OllamaBackend)
    options: dict[str, Any] = {"num_predict": request.max_tokens, "temperature": TEMPERATURE}
    if backend._num_ctx:
        options["num_ctx"] = backend._num_ctx
    body = {
        "model": model,
        "prompt": request.prefix,
        "suffix": request.suffix or "\n",
        "stream": False,
        "options": options,
    }
    response = await _post(backend, "generate", body)
    if response.status_code == 400 and any(w in _words(response) for w in ("insert", "suffix")):
        return None  # "... does not support insert": not a fill-in-the-middle model
    return _read(backend, response, _GENERATED).response


# What a server without fill in the middle answers /v1/completions with.
_NO_ENDPOINT = (404, 405, 501)
_NO_SUFFIX = ("suffix", "not supported", "chat model", "not a completion")


async def _openai(backend: ProviderBackend, model: str, request: Request) -> str | None:
    assert isinstance(backend, OpenAIBackend)
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prefix,
        "max_tokens": request.max_tokens,
        "temperature": TEMPERATURE,
        "stream": False,
    }
    if request.suffix:  # without one this is a plain completion, which every server has
        body["suffix"] = request.suffix
    headers = await backend._request_headers()
    response = await _post(backend, backend._url("completions"), body, headers)
    status = response.status_code
    if status in _NO_ENDPOINT or (
        status in (400, 422) and any(w in _words(response) for w in _NO_SUFFIX)
    ):
        return None
    choices = _read(backend, response, _COMPLETION).choices
    return choices[0].text if choices else ""


def _read(backend: HTTPBackend, response: httpx.Response, decoder: msgspec.json.Decoder[_T]) -> _T:
    if not response.is_success:
        raise backend._error(response.status_code, response.content, response.headers)
    try:
        return decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise backend._bad(f"bad completion ({exc})") from exc


# ---- the chat request ----------------------------------------------------------------------


def chat_messages(request: Request) -> list[Message]:
    # Between tags, so that no provider trims the ends of the text (whitespace at the
    # cursor's end of the file is part of it).
    where = f"File: {request.file}\n" if request.file else ""
    text = f"{request.prefix}{CURSOR}{request.suffix}"
    return [Message("system", CHAT_SYSTEM), Message("user", f"{where}<file>\n{text}\n</file>")]


async def _chat(backend: ProviderBackend, model: str, request: Request) -> str:
    # No thinking where it can be turned off: a completion that thinks first comes too late
    # (Gemini's pro models refuse a budget of 0, so Gemini keeps its default).
    budget = None if backend.name == "gemini" else 0
    params = GenerationParams(
        max_tokens=request.max_tokens, temperature=TEMPERATURE, thinking_budget=budget
    )
    parts: list[str] = []
    async with backend.stream(model, chat_messages(request), [], params) as events:
        async for event in events:
            if event.kind == "content":
                parts.append(event.text)
    return insertion("".join(parts), request.prefix, request.suffix)


# ---- reading a chat model's answer (pure) ---------------------------------------------------

_THINK = re.compile(r"\A\s*<think>.*?(?:</think>|\Z)\s*", re.S)
_TAGGED = re.compile(r"<insert>(.*?)(?:</insert>|\Z)", re.S)
_FENCE = re.compile(r"^[ \t]*(```|~~~)")


def strip_think(text: str) -> str:
    """``text`` without a leading ``<think>`` block (models that think in their text)."""
    return _THINK.sub("", text, count=1)


def _fenced(text: str) -> str | None:
    """The body of the first fenced code block of ``text`` (to its end if unclosed)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if m := _FENCE.match(line):
            body = []
            for inner in lines[i + 1 :]:
                if inner.lstrip().startswith(m[1]):
                    break
                body.append(inner)
            return "\n".join(body).removesuffix("\n")  # an unclosed one: its last line end
    return None


def insertion(answer: str, prefix: str, suffix: str) -> str:
    """What a chat model's ``answer`` says to insert between ``prefix`` and ``suffix``."""
    text = strip_think(answer)
    line = prefix.rpartition("\n")[2]  # the cursor's line, up to the cursor
    if tagged := _TAGGED.search(text):
        text = tagged[1]
        if text.startswith("\n") and not line.strip():
            text = text[1:]  # <insert> on a line of its own, the cursor at a line start
        text = text.removesuffix("\n")
    elif (fenced := _fenced(text)) is not None:
        text = fenced
    else:
        text = text.strip("\n")
    text = text.replace(CURSOR, "")
    # The cursor's line repeated (with or without its indentation): only the rest is new.
    for typed in (line, line.lstrip()):
        if typed and text.startswith(typed):
            text = text[len(typed) :]
            break
    return _without_suffix(text, suffix)


def _without_suffix(text: str, suffix: str) -> str:
    """``text`` without the whole lines at its end that the suffix begins with."""
    ours = text.split("\n")
    theirs = [s.rstrip() for s in suffix.lstrip("\n").split("\n")]
    for n in range(min(len(ours) - 1, len(theirs)), 0, -1):
        tail = [s.rstrip() for s in ours[-n:]]
        if tail == theirs[:n] and any(tail):
            return "\n".join(ours[:-n]).rstrip("\n")
    return text
