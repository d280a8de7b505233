"""Cost of a request from its usage (SPEC 4).

A provider-reported cost (OpenRouter) wins. Otherwise a built-in price table by model-name
prefix, in USD per million tokens (input, output). Unknown models (local ones, mostly)
cost nothing, and so do the backends that are not billed per token: ``ollama`` runs
locally, ``copilot`` and ``kiro`` are flat subscriptions.

The token counts follow ``Usage``'s convention for every provider: ``input_tokens``
includes the cached and the cache-creation tokens (the Anthropic backend adds them up, the
others report them that way). So the full input price applies to ``input - cached -
creation``; cached input costs 10% of it on Anthropic (its own backend, or a Claude model
elsewhere) and 50% on the others; cache creation costs 125%.
"""

from __future__ import annotations

from olliefs.backend.base import Usage

# Longest prefix wins, so specific entries may sit beside general ones.
PRICES: dict[str, tuple[float, float]] = {
    "gpt-4o-mini": (0.15, 0.60),
    "gpt-4o": (2.50, 10.00),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1": (2.00, 8.00),
    "gpt-5-nano": (0.05, 0.40),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-5": (1.25, 10.00),
    "o1-mini": (1.10, 4.40),
    "o1": (15.00, 60.00),
    "o3-mini": (1.10, 4.40),
    "o3": (2.00, 8.00),
    "o4-mini": (1.10, 4.40),
    "claude-3-5-haiku": (0.80, 4.00),
    "claude-3-haiku": (0.25, 1.25),
    "claude-haiku-4": (1.00, 5.00),
    "claude-3-5-sonnet": (3.00, 15.00),
    "claude-3-7-sonnet": (3.00, 15.00),
    "claude-sonnet-4": (3.00, 15.00),
    "claude-opus-4": (15.00, 75.00),
    "claude-opus-4-5": (5.00, 25.00),
    "claude-haiku-4-5": (1.00, 5.00),
    "gemini-1.5-flash": (0.075, 0.30),
    "gemini-1.5-pro": (1.25, 5.00),
    "gemini-2.0-flash": (0.10, 0.40),
    "gemini-2.0-flash-lite": (0.075, 0.30),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-pro": (1.25, 10.00),
}


def _price(model: str) -> tuple[float, float] | None:
    name = model.lower().rsplit("/", 1)[-1]  # "openai/gpt-4o" on OpenRouter
    best = ""
    for prefix in PRICES:
        if name.startswith(prefix) and len(prefix) > len(best):
            best = prefix
    return PRICES[best] if best else None


#: Backends whose requests are not billed per token.
UNMETERED = frozenset({"ollama", "copilot", "kiro"})


def request_cost(model: str, usage: Usage, provider: str = "") -> float:
    """USD for one request of ``model`` on the backend called ``provider``."""
    if usage.cost is not None:
        return usage.cost
    price = _price(model)
    if price is None or provider in UNMETERED:
        return 0.0
    pin, pout = price
    anthropic = provider == "anthropic" or "claude" in model.lower()
    cached_share = 0.10 if anthropic else 0.50
    plain_in = max(usage.input_tokens - usage.cached_input_tokens - usage.cache_creation_tokens, 0)
    total = (
        plain_in * pin
        + usage.cached_input_tokens * pin * cached_share
        + usage.cache_creation_tokens * pin * 1.25
        + usage.output_tokens * pout
    )
    return total / 1_000_000
