"""A replay LLM server: every provider's API, answered from a script, on loopback.

The test-suite uses it as its LLM, and the README demo uses it to show olliefs working
offline. It speaks each provider's wire format byte for byte (OpenAI and Copilot's SSE,
Anthropic's typed SSE events, Ollama's NDJSON, Gemini's SSE, Kiro's AWS event stream;
error bodies, rate-limit headers, dropped and stalled streams), so the real backends talk
to it exactly as they talk to a provider. It listens on loopback only: it has no
authentication worth the name and answers anyone.

Split by concern: ``script`` (the entries and what each field means), ``server`` (HTTP,
routing, how bytes leave: chunks, delays, drops, hangs), ``wire/`` (one module per
provider, translating an entry into that provider's bytes), ``cli`` (``ollie
replay-server``). ollie-replay(1) is the user's manual.
"""

from olliefs.replay.cli import run_cli
from olliefs.replay.script import (
    Entry,
    EntryServerTool,
    EntryToolCall,
    EntryUsage,
    Recorded,
    parse_script,
)
from olliefs.replay.server import ReplayServer

__all__ = [
    "Entry",
    "EntryServerTool",
    "EntryToolCall",
    "EntryUsage",
    "Recorded",
    "ReplayServer",
    "parse_script",
    "run_cli",
]
