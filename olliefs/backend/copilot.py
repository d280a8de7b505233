"""GitHub Copilot chat: the OpenAI wire format on Copilot's endpoint, behind a token exchange.

What GitHub does not document (this module follows what GitHub's own Copilot clients
do, and ollie-replay(1) lists it as unverified):

* the key is a GitHub OAuth token of a Copilot-enabled account (``gho_...``, from an
  editor's device-flow sign-in; personal access tokens are refused). It is exchanged at
  ``GET https://api.github.com/copilot_internal/v2/token`` (``Authorization: token
  <key>``) for a short-lived Copilot token: ``{"token", "expires_at", "refresh_in",
  "endpoints": {"api": ...}}``;
* chat completions and the model list live at ``<endpoints.api>/chat/completions`` and
  ``/models`` (no ``/v1``), with ``Authorization: Bearer <copilot token>`` and the editor
  headers ``Editor-Version``, ``Editor-Plugin-Version``, ``Copilot-Integration-Id`` and
  ``User-Agent``;
* the model list gives context windows as ``capabilities.limits.max_prompt_tokens``;
* a request with images carries ``Copilot-Vision-Request: true``.

The Copilot token is exchanged on first use, again once ``refresh_in`` has passed (or
``expires_at`` is near), and again after the API answered 401 (a token revoked or
expired early): the refused chat request is then sent once more, at once, with the new
token, so the turn goes on; a second 401 fails it. It never leaves this object and is
redacted from every message, like the key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import httpx
import msgspec
import trio

from olliefs.backend.base import BackendError, BadResponseError
from olliefs.backend.openai import OpenAIBackend, parse_base_url

TOKEN_URL = "https://api.github.com/copilot_internal/v2/token"
API_URL = "https://api.githubcopilot.com"
EDITOR_HEADERS = {
    "Editor-Version": "vscode/1.99.3",
    "Editor-Plugin-Version": "copilot-chat/0.26.7",
    "Copilot-Integration-Id": "vscode-chat",
    "User-Agent": "GitHubCopilotChat/0.26.7",
    "Openai-Intent": "conversation-panel",
}


class _Endpoints(msgspec.Struct, gc=False):
    api: str | None = None


class _Token(msgspec.Struct, gc=False):
    token: str
    expires_at: float | None = None
    refresh_in: float | None = None
    endpoints: _Endpoints | None = None


_TOKEN = msgspec.json.Decoder(_Token)


class _Unauthorized(BadResponseError):
    """Copilot's API refused the token (401): it was dropped, and the next request
    exchanges the GitHub token for a new one."""


class CopilotBackend(OpenAIBackend):
    default_model = "gpt-4.1"
    text_tools = False  # hosted models with tool calls of their own: text is text
    # Copilot refuses images in a request without it (as its editors send it).
    image_headers: Mapping[str, str] = MappingProxyType({"Copilot-Vision-Request": "true"})

    def __init__(
        self,
        name: str,
        github_token: str | None,
        *,
        api_url: str | None = None,
        token_url: str = TOKEN_URL,
        read_timeout: float = 300.0,
        default_context_length: int = 128000,
        transport: httpx.AsyncBaseTransport | None = None,
        default_model: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(
            name,
            api_url or API_URL,
            None,  # the GitHub token is only for the exchange, never sent to the API
            read_timeout=read_timeout,
            default_context_length=default_context_length,
            transport=transport,
            extra_headers=EDITOR_HEADERS,
            default_model=default_model,
            normalize=False,
        )
        self._github_token = github_token or None
        if github_token:
            self._secret(github_token)
        self._token_url = str(parse_base_url(token_url))
        self._fixed_api = api_url is not None
        self._api = str(parse_base_url(api_url or API_URL)).rstrip("/")
        self._token: str | None = None
        self._renew_at = 0.0
        self._clock = clock
        self._lock = trio.Lock()

    def _url(self, path: str) -> str:
        return f"{self._api}/{path}"

    async def _request_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self._copilot_token()}"}

    async def _copilot_token(self) -> str:
        async with self._lock:  # one exchange at a time, however many sessions ask
            if self._token is None or self._clock() >= self._renew_at:
                await self._exchange()
            assert self._token is not None
            return self._token

    async def _exchange(self) -> None:
        if not self._github_token:
            raise BadResponseError(
                f"{self.name}: no GitHub token (set OLLIE_COPILOT_KEY to an OAuth token of a "
                "Copilot-enabled account)"
            )
        headers = {"Authorization": f"token {self._github_token}", **EDITOR_HEADERS}
        reply = await self._get(self._token_url, _TOKEN, "token exchange reply", headers=headers)
        now = self._clock()
        self._token = reply.token
        self._secret(reply.token)
        if reply.refresh_in:
            self._renew_at = now + max(reply.refresh_in - 60, 0)
        elif reply.expires_at:
            self._renew_at = reply.expires_at - 300
        else:
            self._renew_at = now + 600
        if not self._fixed_api and reply.endpoints is not None and reply.endpoints.api:
            self._api = str(parse_base_url(reply.endpoints.api)).rstrip("/")

    def _error(
        self, status: int, body: bytes, headers: Mapping[str, str] | None = None
    ) -> BackendError:
        err = super()._error(status, body, headers)
        if status == 401:
            self._token = None  # expired or revoked early: exchange again next time
            return _Unauthorized(str(err))
        return err

    def _renewed(self, err: BackendError) -> bool:
        return isinstance(err, _Unauthorized)

    def forget(self) -> None:
        super().forget()
        self._token = None
