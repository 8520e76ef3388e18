"""The lease protocol's SQL steps (relay/lease/protocol.py has the protocol; relay/sql/lease.sql
the statements), run by the elector on its REPEATABLE READ session."""

from __future__ import annotations

from psycopg import errors

from relay.lease.protocol import (
    Acquired,
    Attempt,
    HeldByOther,
    LeaseToken,
    LostRace,
    OtherShardCount,
    Shard,
)
from relay.sql import QUERIES
from relay.store.db import Conn


def ensure_row(conn: Conn, name: str, shard: Shard | None = None) -> None:
    shard = shard or Shard(name)
    conn.execute(
        QUERIES.lease_ensure,
        {"name": name, "group": shard.group, "shards": shard.shards, "shard": shard.shard},
    )


def try_acquire(
    conn: Conn, name: str, holder: str, ttl: float, shard: Shard | None = None
) -> Attempt:
    """One compare-and-swap attempt. `conn` must be autocommit with REPEATABLE READ."""
    shard = shard or Shard(name)
    assert shard.name == name, f"lease row {name!r} is not {shard}"
    try:
        with conn.transaction():
            claim = conn.execute(
                QUERIES.lease_group_claim, {"group": shard.group, "shards": shard.shards}
            ).fetchone()
            if claim is None or not claim["claimed"]:
                return OtherShardCount(claim["live_other"] if claim else None)
            row = conn.execute(QUERIES.lease_read, {"name": name}).fetchone()
            if row is None:
                return LostRace("lease row missing")
            if row["live"] and row["holder"] != holder:
                return HeldByOther(row["holder"], row["epoch"])
            taken = conn.execute(
                QUERIES.lease_take,
                {"name": name, "holder": holder, "ttl": ttl, "seen_epoch": row["epoch"]},
            ).fetchone()
            if taken is None:
                # Zero rows: someone moved the epoch between our read and our write.
                return LostRace("epoch changed under us")
            return Acquired(LeaseToken(name, holder, int(taken["epoch"])), taken["at"])
    except (errors.SerializationFailure, errors.LockNotAvailable) as exc:
        return LostRace(f"SQLSTATE {exc.sqlstate}")


def renew(conn: Conn, token: LeaseToken, ttl: float) -> bool:
    row = conn.execute(
        QUERIES.lease_renew,
        {"name": token.name, "holder": token.holder, "epoch": token.epoch, "ttl": ttl},
    ).fetchone()
    return row is not None


def release(conn: Conn, token: LeaseToken) -> bool:
    cur = conn.execute(
        QUERIES.lease_release,
        {"name": token.name, "holder": token.holder, "epoch": token.epoch},
    )
    return cur.rowcount == 1
