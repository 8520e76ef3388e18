"""A RabbitMQ node (`rabbitmq-server`, from Debian) on loopback, its own node name, port,
data and log directories, no plugins; plus helpers that declare queues and read them."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aio_pika
from aio_pika.abc import AbstractConnection

from tests.harness import Service, free_port

T = TypeVar("T")
# The harness polls a node that is starting (or being killed) until it answers; aiormq
# would log each refused connection as an error on the test's stderr.
logging.getLogger("aiormq.connection").setLevel(logging.CRITICAL)
SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"  # not the sbin wrapper: it switches user


@dataclass(frozen=True, slots=True)
class Queued:
    """One message as a consumer gets it."""

    body: bytes
    message_id: str
    headers: dict[str, str]
    content_type: str | None
    persistent: bool


class RabbitmqServer(Service):
    def __init__(self) -> None:
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="relay-rabbitmq-"))
        self._proc: subprocess.Popen[bytes] | None = None
        (self._dir / "enabled_plugins").write_text("[].\n")
        (self._dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            # A test machine's disk may be nearly full: never block publishers for it.
            "disk_free_limit.absolute = 1\n"
        )
        atexit.register(self.kill)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "HOME": str(self._dir),  # the Erlang cookie lives here
                "RABBITMQ_NODENAME": f"relaytest{self.port}@localhost",
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(free_port()),
                "RABBITMQ_MNESIA_BASE": str(self._dir / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self._dir / "log"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self._dir / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(self._dir / "rabbitmq"),
                "RABBITMQ_PID_FILE": str(self._dir / "pid"),
            }
        )
        return env

    def start(self) -> None:
        with (self._dir / "server.log").open("ab") as log:
            self._proc = subprocess.Popen(
                [SERVER],
                env=self._env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the node and its helpers: one group to stop
            )
        deadline = time.monotonic() + 90  # 8-23 s on a busy 2-core machine
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited:\n{self.log_tail()}")
            try:
                self.call(lambda _conn: asyncio.sleep(0))
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rabbitmq did not start:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, wait=30)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, wait=10)

    def _signal(self, sig: signal.Signals, wait: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGCONT)  # a paused node must hear the signal
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        # The node itself (beam.smp) may have left the group's leader behind.
        subprocess.run(["pkill", "-KILL", "-f", f"[-]home {self._dir} "], check=False)

    def pause(self) -> None:
        """SIGSTOP the node's whole process group: a broker that hangs, sockets open."""
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill it and start it again, same port and data (durable queues survive, once
        they are on disk: see `persist_definitions`)."""
        self.kill()
        self.start()

    def persist_definitions(self) -> None:
        """A clean stop and start, after which every queue declared so far is on disk.
        A declaration lives in the node's memory for a moment (Mnesia writes its log
        out later): a SIGKILL within it loses the queue, seen about once in six kills
        0.3 s after declaring."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        log = self._dir / "server.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    # --- client helpers (a fresh connection each: the harness is not the system) ---

    def call(self, action: Callable[[AbstractConnection], Awaitable[T]]) -> T:
        async def run() -> T:
            connection = await aio_pika.connect(self.url, timeout=3)
            try:
                return await action(connection)
            finally:
                await connection.close()

        return asyncio.run(run())

    def declare_queue(self, name: str) -> None:
        async def declare(connection: AbstractConnection) -> None:
            channel = await connection.channel()
            await channel.declare_queue(name, durable=True)

        self.call(declare)

    def read_queue(self, name: str) -> list[Queued]:
        """Everything in the queue, in order, left in place (got, then requeued)."""

        async def read(connection: AbstractConnection) -> list[Queued]:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, durable=True, passive=True)
            out: list[Queued] = []
            while (message := await queue.get(no_ack=False, fail=False)) is not None:
                out.append(
                    Queued(
                        body=message.body,
                        message_id=message.message_id or "",
                        headers={k: str(v) for k, v in (message.headers or {}).items()},
                        content_type=message.content_type,
                        persistent=message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
                    )
                )
            return out  # unacknowledged: the channel's close puts them back

        return self.call(read)
