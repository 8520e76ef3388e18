"""The application under test: writes outbox rows the way an app does, and a ledger.

Each message gets a per-key sequence number in its payload (`k7:42 ...`). Writes to one
key are serialized (a lock per key, like an app locking its business row), so id order
per key is commit order — the condition under which the relay promises per-key order.
Transaction shapes: short ones of 1 to 4 keys; long ones that commit seconds late (a lower
id committing after higher ones: the row a last-id cursor would skip); ones that roll
back; poison rows (headers that are not a JSON object, an invalid Kafka topic name).

Ground truth for "committed" is the `chaos_ledger` row written in the SAME transaction:
a commit whose acknowledgement was lost in a database restart is still known exactly.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import psycopg

LEDGER_DDL = """
CREATE TABLE chaos_ledger (
    message_id uuid PRIMARY KEY,
    key        text NOT NULL,
    seq        int  NOT NULL,
    kind       text NOT NULL
)
"""

INSERT_OUTBOX = (
    "INSERT INTO outbox (message_id, topic, key, payload, headers) VALUES (%s, %s, %s, %s, %s)"
)
INSERT_LEDGER = "INSERT INTO chaos_ledger (message_id, key, seq, kind) VALUES (%s, %s, %s, %s)"


@dataclass(slots=True)
class ProducerStats:
    transactions: int = 0
    committed_tx: int = 0
    rolled_back_tx: int = 0
    late_tx: int = 0
    poison: int = 0
    errors: int = 0
    attempted: set[str] = field(default_factory=set)


class Producer:
    """Two writer threads and one late-committer thread, paced to `rate` messages/s."""

    def __init__(
        self,
        dsn: str,
        topic: str,
        *,
        seed: int,
        keys: int,
        target: int,
        rate: float,
        late_hold: tuple[float, float],
        payload_size: int = 100,
    ) -> None:
        self._dsn = dsn
        self._topic = topic
        self._seed = seed
        self._keys = [f"k{i}" for i in range(keys)]
        self._locks = {k: threading.Lock() for k in self._keys}
        self._next_seq = dict.fromkeys(self._keys, 0)
        self._seq_lock = threading.Lock()
        self._target = target
        self._rate = rate
        self._late_hold = late_hold
        self._payload_size = payload_size
        self._count = 0
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._started = 0.0
        self.stats = ProducerStats()
        self._threads = [
            threading.Thread(target=self._writer, args=(n,), name=f"chaos-writer-{n}", daemon=True)
            for n in range(2)
        ] + [threading.Thread(target=self._late_writer, name="chaos-late", daemon=True)]

    # --- control ---

    def start(self) -> None:
        self._started = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def done(self) -> bool:
        return self._stop.is_set() or self.produced >= self._target

    @property
    def produced(self) -> int:
        with self._count_lock:
            return self._count

    # --- writing ---

    def _pace(self) -> None:
        """Sleep until our share of the rate allows the next message."""
        due = self._started + self.produced / self._rate
        delay = due - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)

    def _take_keys(self, rng: random.Random, n: int) -> list[str]:
        taken = []
        for key in rng.sample(self._keys, n):
            if self._locks[key].acquire(blocking=False):
                taken.append(key)
        return taken

    def _payload(self, key: str, seq: int) -> bytes:
        head = f"{key}:{seq} ".encode()
        return head + b"x" * max(0, self._payload_size - len(head))

    def _insert(self, conn: psycopg.Connection[tuple[object, ...]], key: str, kind: str) -> None:
        with self._seq_lock:
            seq = self._next_seq[key]
            self._next_seq[key] = seq + 1
        message_id = str(uuid.uuid4())
        topic, headers = self._topic, json.dumps({"content-type": "text/plain"})
        if kind == "poison":
            if seq % 2:
                headers = json.dumps(["not", "an", "object"])
            else:
                topic = "bad topic!"
        self.stats.attempted.add(message_id)
        conn.execute(INSERT_OUTBOX, (message_id, topic, key, self._payload(key, seq), headers))
        conn.execute(INSERT_LEDGER, (message_id, key, seq, kind))

    def _transaction(
        self, rng: random.Random, keys: list[str], *, hold: float = 0.0, poison: bool = False
    ) -> None:
        rollback = not poison and hold == 0.0 and rng.random() < 0.05
        try:
            with psycopg.connect(self._dsn, connect_timeout=3) as conn:
                for i, key in enumerate(keys):
                    self._insert(conn, key, "poison" if poison and i == 0 else "normal")
                if hold:
                    self._stop.wait(hold)
                if rollback:
                    conn.rollback()
                    self.stats.rolled_back_tx += 1
                else:
                    conn.commit()
                    self.stats.committed_tx += 1
        except psycopg.Error:
            # A database restart: the commit may or may not have landed. The ledger says.
            self.stats.errors += 1
            self._stop.wait(0.2)
        finally:
            self.stats.transactions += 1
            with self._count_lock:
                self._count += len(keys)
            for key in keys:
                self._locks[key].release()

    def _writer(self, n: int) -> None:
        rng = random.Random(self._seed * 1000 + n)
        while not self.done:
            self._pace()
            keys = self._take_keys(rng, rng.randint(1, 4))
            if not keys:
                continue
            poison = rng.random() < 0.01
            self.stats.poison += poison
            self._transaction(rng, keys, poison=poison)

    def _late_writer(self) -> None:
        rng = random.Random(self._seed * 1000 + 99)
        while not self.done:
            keys = self._take_keys(rng, 1)
            if not keys:
                continue
            self.stats.late_tx += 1
            self._transaction(rng, keys, hold=rng.uniform(*self._late_hold))
            self._stop.wait(rng.uniform(0.0, 1.0))
