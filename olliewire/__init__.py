"""What travels between olliefs and toolsrv inside the 9P files (SPEC 5).

Both sides import these Structs, so the JSON in ``tools/<name>/meta``, ``proc/N/call`` and
``proc/N/result`` has one definition. Everything is msgspec: unknown fields in a call are
refused (a typo in a client must not be silently ignored), unknown fields in a result or
a meta are tolerated (an older client keeps working with a newer server).

A package of its own, below both sides: toolsrv never imports olliefs, and the daemon
learns about tools only through its toolsrv connection, so neither may own the contract
(DESIGN). It is not 9P either (``ninep`` is a generic 9P2000 library, also serving the
FUSE tree's export), and imports nothing of the project: only msgspec and the stdlib.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any, Literal

import msgspec

Tier = Literal["hot", "warm", "cold"]

# Agent ids travel as the 9P uname; keep them to what is safe in a path and a log line.
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")

# Environment keys a call may pass to the tool; everything else is dropped by toolsrv.
CALL_ENV_KEYS = frozenset(
    {"OLLIE", "OLLIE_SESSION_ID", "OLLIE_AGENT", "OLLIE_CWD", "OLLIE_MEMORY_DIR", "LANG"}
)


class ToolMeta(msgspec.Struct, frozen=True):
    """``tools/<name>/meta``: what the agent needs to classify and describe a tool."""

    name: str
    description: str
    tier: Tier = "hot"
    parallel: bool = False
    timeout: float = 60.0
    sandbox: str = "default"


class CallRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``proc/N/call``: one tool call. ``args`` is handed to the tool as JSON on stdin."""

    tool: str
    args: dict[str, Any] = {}
    cwd: str = ""
    env: dict[str, str] = {}
    # Checkpoints: the session's store under toolsrv's --capture-dir (empty: no capture),
    # and the conversation's turn the call belongs to (toolsrv.checkpoint).
    capture: str = ""
    turn: int = 0
    review: bool = False  # the changes wait in the store's staged dir (not applied)


IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
"""Image types a result carries to the model as images: what every backend with images
takes (Anthropic's list, the narrowest). Others reach it as a saved file's line."""
MAX_IMAGE = 3_750_000
"""The largest image carried, in bytes: 5 MB once in base64, Anthropic's limit."""
MAX_IMAGES = 8
"""Images carried per result; the rest are saved files' lines only."""


class Content(msgspec.Struct, frozen=True):
    """One piece of a result, as MCP's content. ``type`` "image": ``data`` is the image
    in base64 and ``mimeType`` its type, and ``text`` says what it is in a line, for
    those who read the result as text (chat, events, a backend without images)."""

    text: str
    type: str = "text"
    data: str | msgspec.UnsetType = msgspec.UNSET  # (unset: not in the JSON)
    mimeType: str | msgspec.UnsetType = msgspec.UNSET  # the wire name (MCP's)


class CallResult(msgspec.Struct, frozen=True):
    """``proc/N/result``: MCP-shaped, so a result reads the same wherever it came from."""

    content: list[Content]
    isError: bool = False  # the wire name (SPEC 5)
    # The record of what the call changed (toolsrv.checkpoint); absent: none.
    checkpoint: int | msgspec.UnsetType = msgspec.UNSET

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.content)


def agent_secret(key: bytes, agent_id: str) -> str:
    """The per-agent secret carried in Tattach's aname.

    olliefs holds the master ``key`` (it minted it when it spawned toolsrv, or read it from
    the key file of a remote one) and derives one secret per agent; toolsrv derives the same
    and compares. No registration round trip, nothing to store, and a leaked secret opens
    one agent only.
    """
    return hmac.new(key, agent_id.encode(), hashlib.sha256).hexdigest()


def check_secret(key: bytes, agent_id: str, secret: str) -> bool:
    return hmac.compare_digest(agent_secret(key, agent_id), secret)
