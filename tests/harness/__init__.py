"""Real servers for tests, the demo and the benchmark: PostgreSQL and a Tansu broker."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from types import TracebackType
from typing import Self


class Service:
    """`with Server(...) as s:` starts it and always stops it."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's too: the postgres user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The kernel hands ports of its ephemeral range to every connection a process opens and
# every bind to port 0, on the whole machine. A port picked there for a server started
# seconds later (a relay's metrics, a broker) can meanwhile become a client's source
# port: a chaos replica then stopped at start with "address already in use". Below the
# range the kernel hands out nothing unasked, so only another pick can collide.
_PICKS = random.Random()


def _below_ephemeral() -> range:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12_000), low)


def free_port() -> int:
    """A loopback port nothing listens on now, outside the kernel's ephemeral range."""
    ports = _below_ephemeral()
    while True:
        port = _PICKS.choice(ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
