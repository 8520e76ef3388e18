"""A NATS server with JetStream (`nats-server -js`, from Debian) on loopback, with file
storage that survives a kill, plus helpers that create streams and read them back."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from tests.harness import Service, free_port

T = TypeVar("T")


def find_nats_server() -> str:
    found = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/bin")
    if found is None:
        raise RuntimeError("nats-server not found (./dev test installs it from Debian)")
    return found


@dataclass(frozen=True, slots=True)
class Stored:
    """One message as the stream holds it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]

    @property
    def key(self) -> str | None:
        return self.headers.get("message-key")

    @property
    def message_id(self) -> str:
        return self.headers["message-id"]


class NatsServer(Service):
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="relay-nats-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = self._dir / "server.log"
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            find_nats_server(),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-sd",
            str(self._dir / "store"),
            "-n",
            f"relay-test-{self.port}",
        ]
        with self._log.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited:\n{self.log_tail()}")
            try:
                self.call(lambda nc: nc.jetstream().account_info())
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def pause(self) -> None:
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill it and start it again on the same port and store (streams survive)."""
        self.kill()
        deadline = time.monotonic() + 10
        while _port_busy(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        if not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    # --- client helpers (a fresh connection each: the harness is not the system) ---

    def call(self, action: Callable[[Client], Awaitable[T]]) -> T:
        async def run() -> T:
            nc = await nats.connect(
                self.url, connect_timeout=2, allow_reconnect=False, error_cb=_quiet
            )
            try:
                return await action(nc)
            finally:
                await nc.close()

        return asyncio.run(run())

    def create_stream(
        self, name: str, subjects: list[str], duplicate_window: float = 120.0
    ) -> None:
        config = StreamConfig(name=name, subjects=subjects, duplicate_window=duplicate_window)
        self.call(lambda nc: nc.jetstream().add_stream(config))

    def read_stream(self, name: str) -> list[Stored]:
        """Every message the stream holds, in stream order."""

        async def read(nc: Client) -> list[Stored]:
            js = nc.jetstream()
            info = await js.stream_info(name)
            out: list[Stored] = []
            if not info.state.messages:
                return out
            for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
                try:
                    msg = await js.get_msg(name, seq)
                except NotFoundError:
                    continue
                out.append(
                    Stored(
                        seq=seq,
                        subject=msg.subject or "",
                        data=msg.data or b"",
                        headers=dict(msg.headers or {}),
                    )
                )
            return out

        return self.call(read)


async def _quiet(exc: Exception) -> None:
    return  # the caller sees the exception; nats-py would also print it


def _port_busy(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
