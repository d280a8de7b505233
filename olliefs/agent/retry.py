"""When and how long to wait before retrying a failed request (SPEC 4 and 3.7).

n counts from 0. A 429 waits what the provider asked for (Retry-After / retry-after-ms),
else ``ratelimit_base``·2^n (5 s by default); 5xx, network errors and dropped streams wait
``base``·2^n (2 s by default). Three retries, then the error ends the turn. The bases can
be lowered with ``OLLIE_RETRY_BASE`` / ``OLLIE_RATELIMIT_BASE`` (seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from olliefs.backend.base import BackendError, RateLimitError, TransientError


@dataclass(frozen=True)
class RetryPolicy:
    base: float = 2.0
    ratelimit_base: float = 5.0
    max_retries: int = 3

    @classmethod
    def from_settings(cls, settings: Mapping[str, str]) -> RetryPolicy:
        def num(key: str, default: float) -> float:
            try:
                v = float(settings[key])
            except (KeyError, ValueError):
                return default
            return v if v >= 0 else default

        return cls(num("OLLIE_RETRY_BASE", 2.0), num("OLLIE_RATELIMIT_BASE", 5.0))

    def delay(self, err: BackendError, attempt: int) -> float | None:
        """Seconds to wait before retry number ``attempt`` (from 0), or None: give up."""
        if attempt >= self.max_retries:
            return None
        if isinstance(err, RateLimitError):
            if err.retry_after is not None:
                return max(err.retry_after, 0.0)
            return self.ratelimit_base * 2.0**attempt
        if isinstance(err, TransientError):
            return self.base * 2.0**attempt
        return None
