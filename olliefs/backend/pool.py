"""The backends of one daemon: built from settings once, by name, and shared.

Settings come from the environment or the config ``env`` file (SPEC 4). Keys are read
here and handed to the backend only; the file tree never sees them. Per backend:

=========  =====================================  ==========================================
backend    URL setting (default)                  key settings (first one set wins)
=========  =====================================  ==========================================
openai     OLLIE_OPENAI_URL (api.openai.com/v1)   OLLIE_OPENAI_KEY, OPENAI_API_KEY
anthropic  OLLIE_ANTHROPIC_URL (api.anthropic.com) OLLIE_ANTHROPIC_KEY, ANTHROPIC_API_KEY
ollama     OLLIE_OLLAMA_URL (localhost:11434)     OLLIE_OLLAMA_KEY (optional)
gemini     OLLIE_GEMINI_URL (generativelanguage)  OLLIE_GEMINI_KEY, GEMINI_API_KEY,
                                                  GOOGLE_API_KEY
copilot    OLLIE_COPILOT_URL (from the token)     OLLIE_COPILOT_KEY (a GitHub OAuth token)
kiro       OLLIE_KIRO_URL (codewhisperer)         OLLIE_KIRO_KEY, OLLIE_KIRO_REFRESH_TOKEN
=========  =====================================  ==========================================

and for every backend ``OLLIE_<NAME>_MODEL``, its default model (else the provider's own).
Extra ones: ``OLLIE_READ_TIMEOUT``, ``OLLIE_CONTEXT_LENGTH`` (OpenAI-compatible servers
that do not list one), ``OLLIE_OLLAMA_NUM_CTX``, ``OLLIE_COPILOT_TOKEN_URL``,
``OLLIE_KIRO_AUTH_URL``, ``OLLIE_KIRO_PROFILE_ARN``.

``Pool`` is what the daemon holds: ``get(name)`` creates a backend on first use and hands
the same object to every session after (its HTTP connections and caches are shared);
``models`` / ``context_length`` are answered from the backend's cache, filled on first
ask; ``refresh`` empties those caches and asks again (``ctl models``); ``backends_text``
is the root ``backends`` file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

import trio

from olliefs.backend.anthropic import AnthropicBackend
from olliefs.backend.base import BackendError, ProviderBackend
from olliefs.backend.copilot import TOKEN_URL, CopilotBackend
from olliefs.backend.gemini import GeminiBackend
from olliefs.backend.kiro import API_URL as KIRO_URL
from olliefs.backend.kiro import AUTH_URL as KIRO_AUTH_URL
from olliefs.backend.kiro import KiroBackend
from olliefs.backend.ollama import OllamaBackend
from olliefs.backend.openai import OpenAIBackend

log = logging.getLogger(__name__)
_Number = TypeVar("_Number", int, float)
Settings = Mapping[str, str]


def _positive(settings: Settings, key: str, default: _Number) -> _Number:
    raw = settings.get(key, "").strip()
    if not raw:
        return default
    problem = f"{key} must be a positive {type(default).__name__}, got {raw!r}"
    try:
        value = type(default)(raw)
    except ValueError:
        raise ValueError(problem) from None
    if not value > 0:  # also refuses nan
        raise ValueError(problem)
    return value


def _first(settings: Settings, *keys: str) -> str | None:
    return next((value for key in keys if (value := settings.get(key, "").strip())), None)


def _timeout(settings: Settings) -> float:
    return _positive(settings, "OLLIE_READ_TIMEOUT", 300.0)


def _model(settings: Settings, name: str) -> str | None:
    return _first(settings, f"OLLIE_{name.upper()}_MODEL")


def _openai(settings: Settings) -> ProviderBackend:
    return OpenAIBackend(
        "openai",
        settings.get("OLLIE_OPENAI_URL") or "https://api.openai.com/v1",
        _first(settings, *KEYS["openai"]),
        read_timeout=_timeout(settings),
        default_context_length=_positive(settings, "OLLIE_CONTEXT_LENGTH", 128000),
        default_model=_model(settings, "openai"),
    )


def _anthropic(settings: Settings) -> ProviderBackend:
    return AnthropicBackend(
        "anthropic",
        settings.get("OLLIE_ANTHROPIC_URL") or "https://api.anthropic.com",
        _first(settings, *KEYS["anthropic"]),
        read_timeout=_timeout(settings),
        default_model=_model(settings, "anthropic"),
    )


def _ollama(settings: Settings) -> ProviderBackend:
    num_ctx = settings.get("OLLIE_OLLAMA_NUM_CTX", "").strip()
    return OllamaBackend(
        "ollama",
        settings.get("OLLIE_OLLAMA_URL") or "http://localhost:11434",
        _first(settings, *KEYS["ollama"]),
        read_timeout=_timeout(settings),
        num_ctx=_positive(settings, "OLLIE_OLLAMA_NUM_CTX", 1) if num_ctx else None,
        default_model=_model(settings, "ollama"),
    )


def _gemini(settings: Settings) -> ProviderBackend:
    return GeminiBackend(
        "gemini",
        settings.get("OLLIE_GEMINI_URL") or "https://generativelanguage.googleapis.com",
        _first(settings, *KEYS["gemini"]),
        read_timeout=_timeout(settings),
        default_model=_model(settings, "gemini"),
    )


def _copilot(settings: Settings) -> ProviderBackend:
    return CopilotBackend(
        "copilot",
        _first(settings, *KEYS["copilot"]),
        api_url=settings.get("OLLIE_COPILOT_URL") or None,
        token_url=settings.get("OLLIE_COPILOT_TOKEN_URL") or TOKEN_URL,
        read_timeout=_timeout(settings),
        default_model=_model(settings, "copilot"),
    )


def _kiro(settings: Settings) -> ProviderBackend:
    return KiroBackend(
        "kiro",
        settings.get("OLLIE_KIRO_URL") or KIRO_URL,
        _first(settings, "OLLIE_KIRO_KEY"),
        refresh_token=_first(settings, "OLLIE_KIRO_REFRESH_TOKEN"),
        auth_url=settings.get("OLLIE_KIRO_AUTH_URL") or KIRO_AUTH_URL,
        profile_arn=_first(settings, "OLLIE_KIRO_PROFILE_ARN"),
        read_timeout=_timeout(settings),
        default_model=_model(settings, "kiro"),
    )


_FACTORIES: dict[str, Callable[[Settings], ProviderBackend]] = {
    "openai": _openai,
    "anthropic": _anthropic,
    "ollama": _ollama,
    "gemini": _gemini,
    "copilot": _copilot,
    "kiro": _kiro,
}

#: The settings that hold each backend's credentials, in order of precedence.
KEYS: dict[str, tuple[str, ...]] = {
    "openai": ("OLLIE_OPENAI_KEY", "OPENAI_API_KEY"),
    "anthropic": ("OLLIE_ANTHROPIC_KEY", "ANTHROPIC_API_KEY"),
    "ollama": ("OLLIE_OLLAMA_KEY",),
    "gemini": ("OLLIE_GEMINI_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"),
    "copilot": ("OLLIE_COPILOT_KEY",),
    "kiro": ("OLLIE_KIRO_KEY", "OLLIE_KIRO_REFRESH_TOKEN"),
}


def backend_names() -> list[str]:
    return list(_FACTORIES)


def make_backend(name: str, settings: Settings) -> ProviderBackend:
    """A new backend from settings; ValueError for an unknown name or a bad setting."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        known = ", ".join(backend_names())
        raise ValueError(f"unknown backend {name!r} (known: {known})") from None
    return factory(settings)


def is_configured(name: str, settings: Settings) -> bool:
    """Whether the settings hold what ``name`` needs to be used (not whether it answers).

    A key is needed, except by Ollama (a local server wants none) and by an
    OpenAI-compatible URL of one's own (vLLM, llama.cpp and LM Studio mostly run keyless).
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r}")
    if name == "ollama" or _first(settings, *KEYS[name]):
        return True
    return name == "openai" and _first(settings, "OLLIE_OPENAI_URL") is not None


class Pool:
    """Every backend of the daemon, each created once on first use and then shared."""

    def __init__(
        self,
        settings: Settings,
        factory: Callable[[str, Settings], ProviderBackend] = make_backend,
    ) -> None:
        self._settings = dict(settings)
        self._factory = factory
        self._backends: dict[str, ProviderBackend] = {}
        # One lock per backend: sessions asking the same thing at once share one request.
        self._locks: dict[str, trio.Lock] = {}

    def names(self) -> list[str]:
        return backend_names()

    def check(self, name: str) -> None:
        """ValueError naming the known backends if ``name`` is not one of them."""
        if name not in _FACTORIES:
            raise ValueError(f"unknown backend {name!r} (known: {', '.join(backend_names())})")

    def get(self, name: str) -> ProviderBackend:
        """The backend called ``name``, created on first use (ValueError: unknown or badly
        configured)."""
        if name not in self._backends:
            self.check(name)
            self._backends[name] = self._factory(name, self._settings)
        return self._backends[name]

    def default_model(self, name: str) -> str:
        """``OLLIE_<NAME>_MODEL``, else the provider's own default."""
        return _model(self._settings, name) or self.get(name).default_model

    def configured(self, name: str) -> bool:
        return is_configured(name, self._settings)

    def backends_text(self) -> str:
        """The root ``backends`` file: ``name<TAB>configured|not configured`` per line."""
        return "".join(
            f"{name}\t{'configured' if self.configured(name) else 'not configured'}\n"
            for name in self.names()
        )

    def _lock(self, name: str) -> trio.Lock:
        return self._locks.setdefault(name, trio.Lock())

    async def models(self, name: str) -> list[str]:
        """The models ``name`` offers (cached by the backend; BackendError if it cannot
        tell)."""
        backend = self.get(name)
        async with self._lock(name):
            return await backend.models()

    async def context_length(self, name: str, model: str) -> int:
        """The context window of ``model`` on ``name``, cached per (backend, model).

        Never fails: a provider that cannot tell gives its default, and that default is
        not cached, so a later ask can still learn the real value.
        """
        backend = self.get(name)
        async with self._lock(name):
            try:
                return await backend.context_length(model)
            except BackendError as err:  # a backend's own fallback should prevent this
                log.info("context length of %s/%s unknown (%s)", name, model, err)
                return getattr(backend, "default_context_length", 128000)

    async def refresh(self, name: str) -> list[str]:
        """Forget what ``name`` told before (models, context lengths) and list again."""
        backend = self.get(name)
        async with self._lock(name):
            backend.forget()
            return await backend.models()

    async def aclose(self) -> None:
        backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            await backend.aclose()
