"""Real servers for tests, the demo and the benchmark: PostgreSQL and a Tansu broker."""

from __future__ import annotations

import os
import socket
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
