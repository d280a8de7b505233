"""Build backends from settings (environment or the config ``env`` file).

Keys are read here and handed to the backend only; the file tree never sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from olliefs.backend.base import Backend
from olliefs.backend.openai import OpenAIBackend

_Number = TypeVar("_Number", int, float)


def _positive(settings: Mapping[str, str], key: str, default: _Number) -> _Number:
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


def _openai(settings: Mapping[str, str]) -> Backend:
    return OpenAIBackend(
        "openai",
        settings.get("OLLIE_OPENAI_URL") or "https://api.openai.com/v1",
        settings.get("OLLIE_OPENAI_KEY") or settings.get("OPENAI_API_KEY") or None,
        read_timeout=_positive(settings, "OLLIE_READ_TIMEOUT", 300.0),
        default_context_length=_positive(settings, "OLLIE_CONTEXT_LENGTH", 128000),
    )


_FACTORIES: dict[str, Callable[[Mapping[str, str]], Backend]] = {"openai": _openai}


def backend_names() -> list[str]:
    return list(_FACTORIES)


def make_backend(name: str, settings: Mapping[str, str]) -> Backend:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        known = ", ".join(backend_names())
        raise ValueError(f"unknown backend {name!r} (known: {known})") from None
    return factory(settings)
