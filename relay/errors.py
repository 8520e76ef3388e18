"""Named failures the relay distinguishes; each one decides what the caller does next."""

from __future__ import annotations


class RelayError(Exception):
    """Base class for the relay's own errors."""


class LeaseLost(RelayError):
    """We no longer hold the lease: stop publishing, drop to standby."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MigrationError(RelayError):
    """The schema could not be brought up to date (or was changed after being applied)."""


class SinkUnavailable(RelayError):
    """The sink as a whole cannot take messages now (broker down, endpoint unreachable)."""
