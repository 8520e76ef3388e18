"""Cut one process off from the broker while the others still reach it.

A Kafka client dials the bootstrap address and then whatever address the broker
advertises, so a proxy on the bootstrap port alone would be bypassed. Instead the broker
advertises `localhost:P`, and each process to be cut runs in its own mount namespace
whose /etc/hosts maps `localhost` to a loopback address of its own, 127.0.0.N. There a
`TcpProxy` listens on port P and forwards to the broker on 127.0.0.1:P. Everyone else
(the test process, consumers, admin clients) resolves `localhost` to 127.0.0.1 as usual.

`TcpProxy.cut()` is a network partition, not a refusal: connections stay open and go
silent both ways, new ones are accepted and then ignored. `heal()` closes every held
connection, dropping what the cut process wrote meanwhile, and forwards again.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import Service

_CHUNK = 64 * 1024
_HIGH_WATER = 1024 * 1024  # per direction: stop reading the source until this drains
_CONNECT_TIMEOUT = 2.0
_MOUNT_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'
_PROBE_ADDRESS = "127.0.0.254"


def loopback(n: int) -> str:
    """The n-th address for a cuttable process: 127.0.0.10 and up, clear of 127.0.0.1."""
    if not 0 <= n < 240:
        raise ValueError(f"no loopback address for process {n}")
    return f"127.0.0.{10 + n}"


def hosts_file(localhost: str) -> str:
    """The machine's /etc/hosts with `localhost` meaning `localhost` (and only that): a
    name on two lines (127.0.0.1 and ::1) would let the client pick the broker directly."""
    lines = [f"{localhost} localhost"]
    try:
        original = Path("/etc/hosts").read_text(errors="replace").splitlines()
    except OSError:
        original = []
    for line in original:
        entry = line.split("#", 1)[0].split()
        if len(entry) < 2:
            continue
        names = [name for name in entry[1:] if name.lower() != "localhost"]
        if names:
            lines.append(" ".join([entry[0], *names]))
    return "\n".join(lines) + "\n"


def namespaced(argv: Sequence[str], localhost: str, directory: Path | None = None) -> list[str]:
    """`argv` in a private mount namespace where `localhost` resolves to `localhost`.

    The shell execs the command after the bind mount, and unshare without --fork execs
    too: a Popen of the result has the command's own pid (signals reach it directly).
    """
    directory = directory or Path(tempfile.mkdtemp(prefix="relay-netcut-"))
    hosts = directory / f"hosts-{localhost}"
    hosts.write_text(hosts_file(localhost))
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        _MOUNT_HOSTS,
        str(hosts),
        *argv,
    ]


@functools.cache
def namespaces_available() -> bool:
    """Root with unshare and mount, and a namespaced process really resolves
    `localhost` to its own address (a container may deny the mount even to root)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    if not (shutil.which("unshare") and shutil.which("mount")):
        return False
    probe = [sys.executable, "-c", "import socket; print(socket.gethostbyname('localhost'))"]
    with tempfile.TemporaryDirectory(prefix="relay-netcut-") as directory:
        try:
            done = subprocess.run(
                namespaced(probe, _PROBE_ADDRESS, Path(directory)),
                capture_output=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return done.returncode == 0 and done.stdout.decode().strip() == _PROBE_ADDRESS


@dataclass(eq=False, slots=True)
class _Pipe:
    """One client connection and its upstream twin, with what each side still owes."""

    client: socket.socket
    upstream: socket.socket | None
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    held: bool = False  # cut: nothing moves, the sockets stay open
    ending: bool = False  # one side closed: flush what is buffered, then close both


class TcpProxy(Service):
    """Forwards `host:port` to `upstream`, on one selector thread, until cut.

    Each new connection dials upstream afresh, so a broker restarted on the same port
    (chaos kill_broker) is reached again without the proxy noticing. All socket work
    happens under one lock on the loop thread: when `cut()` returns, not one more byte
    is forwarded either way.
    """

    def __init__(self, host: str, port: int, upstream: tuple[str, int]) -> None:
        self.host = host
        self.port = port
        self.upstream = upstream
        self.accepted = 0  # connections ever accepted: proof the process dialed through us
        self._cut = False
        self._pipes: set[_Pipe] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def is_cut(self) -> bool:
        return self._cut

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._listener = listener
        self._closing.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"netcut-{self.host}:{self.port}", daemon=True
        )
        self._thread.start()

    def cut(self) -> None:
        """Partition: every open connection goes silent both ways, still open; bytes
        read but not yet forwarded are dropped."""
        with self._lock:
            self._cut = True
            for pipe in self._pipes:
                if not pipe.held:
                    pipe.held = True
                    pipe.to_upstream.clear()
                    pipe.to_client.clear()
                    self._watch(pipe.client, 0)
                    if pipe.upstream is not None:
                        self._watch(pipe.upstream, 0)

    def heal(self) -> None:
        """Close every held connection (unread bytes die with it, so nothing the cut
        process wrote lands late); new connections are forwarded again."""
        with self._lock:
            self._cut = False
            for pipe in [p for p in self._pipes if p.held]:
                self._drop(pipe)

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            for pipe in list(self._pipes):
                self._drop(pipe)
            if self._selector is not None:
                self._selector.close()
                self._selector = None
            if self._listener is not None:
                self._listener.close()
                self._listener = None

    def stop(self) -> None:
        self.close()

    # --- the loop thread ---

    def _run(self) -> None:
        selector = self._selector
        assert selector is not None
        while not self._closing.is_set():
            # Short timeout: cut() and heal() change registrations from another thread,
            # and a select already under way only needs to end soon, not at once.
            ready = selector.select(timeout=0.1)
            with self._lock:
                if self._closing.is_set():
                    return
                for key, mask in ready:
                    if key.data is None:
                        self._accept()
                        continue
                    pipe, from_client = key.data
                    if pipe in self._pipes and not pipe.held:
                        self._service(pipe, from_client=from_client, mask=mask)

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # nothing more to accept now (or the listener is closing)
                return
            self.accepted += 1
            if self._cut:
                # A partition: the handshake completes (the kernel does it anyway), then
                # nothing. Not even read: the client's writes pile up as on a dead link.
                self._pipes.add(_Pipe(client, None, held=True))
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=_CONNECT_TIMEOUT)
            except OSError:
                client.close()  # the broker is down: the client sees it go away
                continue
            for sock in (client, upstream):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(client, upstream)
            self._pipes.add(pipe)
            self._update(pipe)

    def _service(self, pipe: _Pipe, *, from_client: bool, mask: int) -> None:
        assert pipe.upstream is not None
        source = pipe.client if from_client else pipe.upstream
        onward = pipe.to_upstream if from_client else pipe.to_client
        if mask & selectors.EVENT_READ and not pipe.ending:
            try:
                data = source.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._drop(pipe)
                return
            if data == b"":
                pipe.ending = True
            elif data:
                onward += data
        if not (
            self._flush(pipe.upstream, pipe.to_upstream)
            and self._flush(pipe.client, pipe.to_client)
        ):
            self._drop(pipe)
            return
        if pipe.ending and not pipe.to_upstream and not pipe.to_client:
            self._drop(pipe)
            return
        self._update(pipe)

    def _flush(self, sock: socket.socket, buffer: bytearray) -> bool:
        """Send what the socket takes now; False if the connection is broken."""
        while buffer:
            try:
                sent = sock.send(buffer)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            del buffer[:sent]
        return True

    def _update(self, pipe: _Pipe) -> None:
        assert pipe.upstream is not None
        for sock, inbound, outbound in (
            (pipe.client, pipe.to_upstream, pipe.to_client),
            (pipe.upstream, pipe.to_client, pipe.to_upstream),
        ):
            events = 0
            if not pipe.ending and len(inbound) < _HIGH_WATER:
                events |= selectors.EVENT_READ
            if outbound:
                events |= selectors.EVENT_WRITE
            self._watch(sock, events, (pipe, sock is pipe.client))

    def _watch(self, sock: socket.socket, events: int, data: object = None) -> None:
        """Register, modify or unregister `sock` so the selector wants exactly `events`."""
        selector = self._selector
        if selector is None or sock.fileno() < 0:
            return
        try:
            key = selector.get_key(sock)
        except KeyError:
            if events:
                selector.register(sock, events, data)
            return
        if not events:
            selector.unregister(sock)
        elif key.events != events:
            selector.modify(sock, events, key.data)

    def _drop(self, pipe: _Pipe) -> None:
        self._pipes.discard(pipe)
        for sock in (pipe.client, pipe.upstream):
            if sock is None:
                continue
            self._watch(sock, 0)
            sock.close()
