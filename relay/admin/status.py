"""What `relay status` reads, and the JSON it prints: one builder for the command's
`--json` and the console's API (`GET /api/v1/status`), so a script reads the same
document from either. Beside the command line rather than in it: the console may not
import `relay.admin.cli` (an import-linter contract)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from relay.admin.migrate import SchemaState, schema_state
from relay.admin.pauses import PausedTopic, paused_topics
from relay.admin.schema_options import shard_index_state
from relay.observe import lag
from relay.store import connection, db, repository
from relay.store.rows import LeaseRow, ReplicaRow

ShardLags = dict[tuple[str, int], lag.ShardLag]  # by (lease group, shard)


@dataclass(frozen=True, slots=True)
class Status:
    schema: SchemaState
    leases: list[LeaseRow]
    replicas: list[ReplicaRow]
    sample: lag.LagSample
    shard_lag: ShardLags
    paused: list[PausedTopic]

    def as_json(self) -> dict[str, Any]:
        """`relay status --json`'s document (times stay datetimes: `json_default`)."""
        outbox: dict[str, Any] = self.sample.as_dict()
        if self.shard_lag:
            outbox["shards"] = [
                {"lease_group": group, **s.as_dict()} for (group, _), s in self.shard_lag.items()
            ]
        return {
            "schema_version": self.schema.version,
            "migrations_not_applied": self.schema.not_applied,
            "migrations_of_a_newer_release": self.schema.newer,
            "leases": [asdict(lease) for lease in self.leases],
            "replicas": [asdict(replica) for replica in self.replicas],
            "outbox": outbox,
            "paused_topics": [asdict(paused) for paused in self.paused],
        }


def read_status(conn: db.Conn, cap: int) -> Status:
    """Leases, heartbeats, the outbox's counts (each stopping at `cap`), the paused
    topics and the schema."""
    leases = repository.lease_status(conn)
    replicas = repository.replica_status(conn)
    sample = lag.measure(conn, cap)
    shards = shard_lag(conn, cap)
    return Status(schema_state(conn), leases, replicas, sample, shards, paused_topics(conn))


def shard_lag(conn: db.Conn, cap: int) -> ShardLags:
    """Each shard's backlog, for every lease group whose shard count in force has its
    indexes (without them the per-shard count would read the whole outbox)."""
    found: ShardLags = {}
    for group, shards in repository.lease_group_shards(conn).items():
        if shards > 1 and all(shard_index_state(conn, shards).values()):
            connection.keep_settings(conn, connection.CUSTOM_PLANS)
            for s in lag.measure_shards(conn, shards, cap):
                found[group, s.shard] = s
    return found


def json_default(value: Any) -> str:
    """How a value JSON has no type for prints: times in ISO 8601, the rest (ids,
    UUIDs) as their text."""
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)
