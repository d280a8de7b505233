"""Cost of a request from its usage (SPEC 4).

A provider-reported cost (OpenRouter) wins. Otherwise a built-in price table by model-name
prefix, in USD per million tokens (input, output). Cached input costs 10% of the input price
for Anthropic models and 50% for the others; cache creation costs 125%. Unknown models
(local ones, mostly) cost nothing.
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
    "gemini-1.5-flash": (0.075, 0.30),
    "gemini-1.5-pro": (1.25, 5.00),
    "gemini-2.0-flash": (0.10, 0.40),
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


def request_cost(model: str, usage: Usage) -> float:
    if usage.cost is not None:
        return usage.cost
    price = _price(model)
    if price is None:
        return 0.0
    pin, pout = price
    cached_share = 0.10 if "claude" in model.lower() else 0.50
    plain_in = max(usage.input_tokens - usage.cached_input_tokens, 0)
    total = (
        plain_in * pin
        + usage.cached_input_tokens * pin * cached_share
        + usage.cache_creation_tokens * pin * 1.25
        + usage.output_tokens * pout
    )
    return total / 1_000_000
