"""Exponential backoff with jitter, the one implementation every retry path uses."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before attempt `n+1` after `n` failures.

    "Equal jitter": a uniform draw in [ceiling/2, ceiling]. Never zero (a retry storm
    against a struggling sink helps nobody) and never above `cap`.
    """

    base: float
    cap: float
    multiplier: float = 2.0

    def delay(self, failures: int) -> float:
        if failures < 1:
            return 0.0
        # Bound the exponent so huge attempt counts cannot overflow a float.
        exponent = min(failures - 1, 64)
        ceiling = min(self.cap, self.base * self.multiplier**exponent)
        return random.uniform(ceiling / 2, ceiling)


def retry_delay(backoff: Backoff, attempts: int, retry_after: float | None) -> float:
    """When a failed row goes again: our backoff, or the sink's Retry-After when longer,
    spread by up to 20 % so the rows it throttled do not all come back in the same
    instant; never past the backoff's cap. With no attempt (a row the sink deferred:
    nothing failed) the sink's time as it is: it spread its rows itself."""
    if attempts < 1:
        return min(max(retry_after or 0.0, 0.0), backoff.cap)
    delay = backoff.delay(attempts)
    if retry_after is None or retry_after <= delay:
        return delay
    return min(retry_after * random.uniform(1.0, 1.2), backoff.cap)


@dataclass(slots=True)
class Retrying:
    """Mutable failure counter around a `Backoff`, for loops that retry one thing."""

    backoff: Backoff
    failures: int = field(default=0)

    def next_delay(self) -> float:
        self.failures += 1
        return self.backoff.delay(self.failures)

    def reset(self) -> None:
        self.failures = 0


def jittered(interval: float, spread: float = 0.2) -> float:
    """`interval` +/- `spread` (a fraction), so replicas do not poll in lock step."""
    return interval * random.uniform(1 - spread, 1 + spread)
