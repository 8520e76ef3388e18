"""What a chaos run records, as plain data the checker reads (no servers, no clocks).

- `Produced`: a message whose transaction COMMITTED (ground truth: a ledger row written
  in the same transaction), normal or poison.
- `Delivered`: one record the consumer read, in broker order.
- `Acquired` / `Settled`: the replicas' `lease.acquired` and `batch.settled` log events,
  each stamped with the database's clock read under the lease row's lock.
- `Fault`: what was injected, and how many messages it could have put in flight twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

Kind = Literal["normal", "poison"]


@dataclass(frozen=True, slots=True)
class Produced:
    message_id: str
    key: str
    seq: int
    kind: Kind = "normal"


@dataclass(frozen=True, slots=True)
class Delivered:
    message_id: str
    key: str | None
    seq: int | None  # parsed from the payload `key:seq`
    generation: int = 0  # broker incarnation (an in-memory broker restarts empty)
    partition: int = 0
    offset: int = 0


@dataclass(frozen=True, slots=True)
class Acquired:
    holder: str
    epoch: int
    db_time: datetime
    lease: str = "default"  # the lease row (a shard's: default#3/8); epochs are per row


@dataclass(frozen=True, slots=True)
class Settled:
    holder: str
    epoch: int
    db_time: datetime
    sent: int = 0
    first_id: int = 0
    last_id: int = 0
    lease: str = "default"


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    at: float  # seconds since the run started
    duration: float = 0.0
    in_flight_bound: int = 0  # messages this fault can make the relay publish twice
    takeover_seconds: float | None = None  # leader faults: until a new epoch was live
    note: str = ""


@dataclass(slots=True)
class History:
    committed: list[Produced] = field(default_factory=list)
    attempted_ids: set[str] = field(default_factory=set)  # every message_id ever inserted
    delivered: list[Delivered] = field(default_factory=list)
    acquisitions: list[Acquired] = field(default_factory=list)
    settles: list[Settled] = field(default_factory=list)
    dead_letters: dict[str, str | None] = field(default_factory=dict)  # message_id -> reason
    faults: list[Fault] = field(default_factory=list)
    recovery_seconds: float | None = None  # last fault healed -> lag 0, everything consumed
    recovery_bound: float = 60.0


def parse_payload(value: bytes | None) -> tuple[str | None, int | None]:
    """Payloads are `key:seq` (plus padding after a space)."""
    if not value:
        return None, None
    head = value.split(b" ", 1)[0].decode(errors="replace")
    key, _, seq = head.rpartition(":")
    return (key, int(seq)) if seq.isdigit() else (None, None)


def log_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a replica's log; other lines (a crash's stray output) skipped."""
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by SIGKILL
        if isinstance(event, dict):
            yield event


def lease_history(lines: Iterable[str]) -> tuple[list[Acquired], list[Settled]]:
    acquisitions: list[Acquired] = []
    settles: list[Settled] = []
    for event in log_events(lines):
        name = event.get("event")
        if name == "lease.acquired" and event.get("db_time"):
            acquisitions.append(
                Acquired(
                    event["holder"],
                    int(event["epoch"]),
                    datetime.fromisoformat(event["db_time"]),
                    str(event.get("lease", "default")),
                )
            )
        elif name == "batch.settled":
            settles.append(
                Settled(
                    event["holder"],
                    int(event["epoch"]),
                    datetime.fromisoformat(event["db_time"]),
                    int(event.get("sent", 0)),
                    int(event.get("first_id", 0)),
                    int(event.get("last_id", 0)),
                    str(event.get("lease", "default")),
                )
            )
    return acquisitions, settles


def read_lease_history(paths: Iterable[Path]) -> tuple[list[Acquired], list[Settled]]:
    acquisitions: list[Acquired] = []
    settles: list[Settled] = []
    for path in paths:
        a, s = lease_history(path.read_text(errors="replace").splitlines())
        acquisitions += a
        settles += s
    return acquisitions, settles
