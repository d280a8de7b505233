"""The backend pool: one backend per name, shared; model data cached and refreshable.

The loopback tests point every backend at one real replay server and then stop it: what
the pool still answers came from its caches, and what it cannot answer proves it asked.
"""

from __future__ import annotations

import pytest

from olliefs.backend.base import BackendError
from olliefs.backend.pool import Pool, backend_names, is_configured, make_backend
from olliefs.replay import ReplayServer

NAMES = ["openai", "anthropic", "ollama", "gemini", "copilot", "kiro"]


async def test_each_backend_is_created_once_and_shared() -> None:
    made: list[str] = []

    def factory(name: str, settings: object) -> object:
        made.append(name)
        return make_backend(name, {})

    pool = Pool({}, factory)  # type: ignore[arg-type]
    first = pool.get("anthropic")
    assert pool.get("anthropic") is first
    pool.get("openai")
    assert made == ["anthropic", "openai"]
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*anthropic"):
        pool.get("nope")
    await pool.aclose()


async def test_default_models() -> None:
    pool = Pool({"OLLIE_GEMINI_MODEL": "gemini-2.5-pro"})
    defaults = {name: pool.default_model(name) for name in pool.names()}
    assert defaults == {
        "openai": "gpt-4o-mini",
        "anthropic": "claude-sonnet-4-5",
        "ollama": "llama3.2",
        "gemini": "gemini-2.5-pro",
        "copilot": "gpt-4.1",
        "kiro": "claude-sonnet-4",
    }
    await pool.aclose()


def test_configured_and_the_backends_file() -> None:
    assert backend_names() == NAMES
    settings = {"ANTHROPIC_API_KEY": "k", "OLLIE_KIRO_REFRESH_TOKEN": "r", "GOOGLE_API_KEY": "g"}
    assert Pool(settings).backends_text() == (
        "openai\tnot configured\n"
        "anthropic\tconfigured\n"
        "ollama\tconfigured\n"  # a local server needs no key
        "gemini\tconfigured\n"
        "copilot\tnot configured\n"
        "kiro\tconfigured\n"
    )
    assert is_configured("openai", {"OLLIE_OPENAI_URL": "http://localhost:8000"})  # vLLM & co
    assert not is_configured(
        "anthropic", {"OLLIE_ANTHROPIC_URL": "http://x", "ANTHROPIC_API_KEY": " "}
    )
    with pytest.raises(ValueError):
        is_configured("nope", {})


def test_keys_never_show_in_the_backends_file() -> None:
    settings = {f"OLLIE_{n.upper()}_KEY": f"secret-{n}" for n in NAMES}
    assert "secret" not in Pool(settings).backends_text()


@pytest.mark.parametrize("name", NAMES)
async def test_models_and_context_lengths_are_cached_per_backend(name: str) -> None:
    server = ReplayServer(key="k-123", models=("replay", "other"), context_length=32000).start()
    pool = Pool({**server.settings(), "OLLIE_READ_TIMEOUT": "5"})
    try:
        assert await pool.models(name) == ["replay", "other"]
        assert await pool.context_length(name, "other") == 32000
    finally:
        server.stop()
    # the server is gone: the answers come from the cache
    assert await pool.models(name) == ["replay", "other"]
    assert await pool.context_length(name, "other") == 32000
    with pytest.raises(BackendError, match=f"^{name}: network error"):
        await pool.refresh(name)  # asks again, really
    await pool.aclose()


async def test_an_unknown_context_length_is_not_cached() -> None:
    server = ReplayServer(context_length=64000).start()
    port = server.port
    server.stop()  # nothing listens there now
    pool = Pool({**server_settings(port), "OLLIE_CONTEXT_LENGTH": "5000"})
    assert await pool.context_length("openai", "replay") == 5000  # the default, not kept
    with ReplayServer(port=port, context_length=64000):
        assert await pool.context_length("openai", "replay") == 64000
    await pool.aclose()


def server_settings(port: int) -> dict[str, str]:
    return {"OLLIE_OPENAI_URL": f"http://127.0.0.1:{port}/v1"}
