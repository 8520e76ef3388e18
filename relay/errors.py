"""The relay's own errors, one base class: each name says what the caller does next."""

from __future__ import annotations


class RelayError(Exception):
    """Base class for the relay's own errors."""


class SettingsError(RelayError):
    """A setting is missing or invalid; `name` is the environment variable to fix.
    Start-up stops with the message, which never quotes a secret."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


class MigrationError(RelayError):
    """The schema could not be brought up to date (or was changed after being applied)."""


class MalformedRow(RelayError):
    """The row cannot be published as it is; retrying will not help (dead-letter it)."""
