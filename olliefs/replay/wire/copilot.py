"""GitHub Copilot: the OpenAI wire format, reached through a token exchange.

``GET /copilot_internal/v2/token`` with ``Authorization: token <GitHub token>`` answers
``{"token", "expires_at", "refresh_in", "endpoints": {"api"}}``; chat and model requests
then carry ``Authorization: Bearer <that token>`` and the editor headers, which the real
service insists on and this server checks (a request without them gets the 400 Copilot
answers). The chat stream itself is the OpenAI wire (``wire/openai.py``). None of this is
documented by GitHub; ollie-replay(1) says so.
"""

from __future__ import annotations

import time
from typing import Any

from olliefs.replay.wire import dumps

REQUIRED_HEADERS = ("Editor-Version", "Copilot-Integration-Id")
TOKEN_PATH = "/copilot_internal/v2/token"


def token_reply(token: str, api: str, lifetime: int = 1800) -> bytes:
    now = int(time.time())
    doc: dict[str, Any] = {
        "token": token,
        "expires_at": now + lifetime,
        "refresh_in": lifetime - 300,
        "endpoints": {"api": api},
        "chat_enabled": True,
        "sku": "replay",
    }
    return dumps(doc)


def missing_headers(headers: Any) -> list[str]:
    return [name for name in REQUIRED_HEADERS if not headers.get(name)]
