"""Structured output: what compaction asks each provider for, checked by its official SDK.

Our request bodies are made by the backends' own ``request_body`` functions with the
compaction's ``RESPONSE_SCHEMA``; each SDK then says whether it is the request it would
make: OpenAI's types and its strict-schema rules (the SDK's own ``to_strict_json_schema``
must leave our schema as it is), Anthropic's ``ToolParam`` / ``ToolChoiceToolParam``
and what its stream accumulator reads as the forced tool's input, Gemini's ``Schema``
(our conversion must equal the SDK's ``Schema.from_json_schema``), Ollama's
``ChatRequest`` and the body its client sends. Kiro has no structured output.
"""

from __future__ import annotations

import copy
from typing import Any

import anthropic
import ollama
import pydantic
from anthropic.types import ToolChoiceToolParam, ToolParam
from google.genai import types as genai_types
from ollama._types import ChatRequest
from openai.lib._pydantic import _ensure_strict_json_schema
from openai.types.chat import completion_create_params

from olliefs.agent import compact as C
from olliefs.agent.compact import ANSWER_NAME, ANSWER_SCHEMA, RESPONSE_SCHEMA
from olliefs.agent.taskstate import TaskState
from olliefs.backend.anthropic import request_body as anthropic_body
from olliefs.backend.base import GenerationParams, Message
from olliefs.backend.gemini import request_body as gemini_body
from olliefs.backend.ollama import request_body as ollama_body
from olliefs.backend.openai import request_body as openai_body
from olliefs.replay import Entry, EntryToolCall, ReplayServer
from tests.contract.harness import KEY, backend

ASKED = GenerationParams(max_tokens=1000, response_schema=RESPONSE_SCHEMA)
MESSAGES = [Message("system", "be brief"), Message("user", "compact this")]
ANSWER = {
    "goal": "count",
    "state": "counted to three",
    "decisions": ["use ints"],
    "next": "stop",
    "open_questions": [],
    "files": [],
    "results": [{"id": "c1", "summary": "listed two files"}],
}


def test_openai_response_format_is_the_sdks_strict_json_schema() -> None:
    body = openai_body("gpt-4o", MESSAGES, [], ASKED)
    form = body["response_format"]
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(
        completion_create_params.ResponseFormat
    )
    assert adapter.validate_python(form) == form
    schema = form["json_schema"]["schema"]
    # What the SDK makes of a schema to send it strict: nothing to change in ours.
    assert _ensure_strict_json_schema(copy.deepcopy(schema), path=(), root=schema) == schema
    assert form["json_schema"]["strict"] is True


async def test_anthropic_forced_tool_is_what_the_sdk_sends_and_reads(
    server: ReplayServer,
) -> None:
    body = anthropic_body("replay", MESSAGES, [], ASKED)
    [tool] = body["tools"]
    tool_adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ToolParam)
    choice_adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ToolChoiceToolParam)
    assert tool_adapter.validate_python(tool) == tool
    assert choice_adapter.validate_python(body["tool_choice"]) == body["tool_choice"]
    # The answer as the API gives it: the forced tool's call. The SDK's accumulator and
    # our compaction read the same answer from the same bytes.
    entry = Entry(
        tool_calls=(EntryToolCall(name=ANSWER_NAME, arguments=ANSWER, id="toolu_a"),), chunk=5
    )
    server.add([entry])
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    with (
        client,
        client.messages.stream(
            model="replay",
            max_tokens=1000,
            messages=[{"role": "user", "content": "compact this"}],
            tools=[tool],
            tool_choice=body["tool_choice"],
        ) as stream,
    ):
        final = stream.get_final_message()
    [block] = final.content
    assert block.type == "tool_use" and block.name == ANSWER_NAME
    sdk_request = server.recorded[-1].body
    assert sdk_request["tools"] == [tool] and sdk_request["tool_choice"] == body["tool_choice"]
    server.add([entry])
    ours = backend(server, "anthropic")
    try:
        p = C.plan([Message("user", "a"), Message("assistant", "b")] * 5, TaskState())
        res = await C.compact(ours, "replay", p, ASKED)
    finally:
        await ours.aclose()
    assert not res.mechanical
    assert res.state.progress == block.input["state"] == ANSWER["state"]
    assert server.recorded[-1].schema == ANSWER_SCHEMA


def test_gemini_response_schema_is_the_sdks_conversion() -> None:
    config = gemini_body(MESSAGES, [], ASKED)["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    sdk_config = genai_types.GenerateContentConfig.model_validate(config)
    assert sdk_config.response_mime_type == "application/json"
    ours = genai_types.Schema.model_validate(config["responseSchema"])  # extra="forbid"
    theirs = genai_types.Schema.from_json_schema(
        json_schema=genai_types.JSONSchema.model_validate(ANSWER_SCHEMA), api_option="GEMINI_API"
    )

    def unordered(schema: genai_types.Schema) -> dict[str, Any]:
        """The schema without ``property_ordering`` (we send it, so that the answer
        comes in the order the prompt shows; the SDK's conversion adds none)."""
        dump: dict[str, Any] = schema.model_dump(exclude_none=True)

        def strip(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: strip(v) for k, v in node.items() if k != "property_ordering"}
            return node

        return strip(dump)  # type: ignore[no-any-return]

    assert unordered(ours) == unordered(theirs)
    assert ours.property_ordering == list(ANSWER_SCHEMA["properties"])


def test_ollama_format_is_what_the_sdk_sends(server: ReplayServer) -> None:
    body = ollama_body("replay", MESSAGES, [], ASKED)
    assert ChatRequest.model_validate(body).format == ANSWER_SCHEMA
    server.add([Entry(reply='{"goal": "g", "state": "s"}')])
    client = ollama.Client(host=server.base_url, timeout=20)
    try:
        list(
            client.chat(
                model="replay",
                messages=[{"role": "user", "content": "compact this"}],
                format=ANSWER_SCHEMA,
                stream=True,
            )
        )
    finally:
        client.close()  # type: ignore[no-untyped-call]
    sent = server.recorded[-1]
    assert sent.body["format"] == body["format"] and sent.schema == ANSWER_SCHEMA
