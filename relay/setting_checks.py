"""Checks the settings modules share: files that settings name (secrets read from them,
certificates and keys checked at start-up, so a missing mount is a setting to fix, not
a traceback later) and whether a host is this machine (where plaintext is no exposure).

Shared by `relay.settings`, `relay.store.db` and the sinks' settings modules, which cannot
import `relay.settings` (it is made of them).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from relay.errors import SettingsError


def read_secret(variable: str, path: str) -> str:
    """The secret in the file `variable` names, without surrounding whitespace
    (`echo pw > file` leaves a newline). Errors name the variable, never the content."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SettingsError(variable, f"cannot read file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(variable, "the file is not UTF-8 text") from None


def unreadable(path: str, *, directory_ok: bool = False) -> str | None:
    """Why this process cannot read the file at `path` (a directory of certificates
    too, with `directory_ok`), or None if it can."""
    target = Path(path)
    try:
        if directory_ok and target.is_dir():
            with os.scandir(target):
                return None
        with target.open("rb"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1), bracketed or not."""
    name = host.strip().strip("[]").split("%", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
