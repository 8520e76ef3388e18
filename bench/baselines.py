"""Honest baselines (issue 36): the job's floor without the relay's machinery or its
index set, and what the outbox costs the app's writes, measured in the same run.

Two tables beside the relay's `outbox`, dropped afterwards:
  minimal  only what a select-and-mark loop needs: the columns it reads (the outbox's
           id, message_id, topic, key, payload, headers, created_at, attempts, with their
           defaults and identity) and a `sent_at` to mark, a primary key and the one
           partial index such a loop walks, `(id) WHERE sent_at IS NULL`
  bare     `LIKE outbox` (the outbox's columns, defaults and identity, whatever the
           schema makes them) with a primary key only: the app's write path without any
           outbox index

1. Raw loops, one transaction a batch: select the next unsent rows by id, then keep
   them (retention mode) or delete them, at batch 2000 and 500, on the minimal table and
   on `outbox` in turn, which goes first alternating (the same code; on `outbox` the
   select is the one of section 1 of the full run, a walk of its primary key, as the
   relay's fetch walks it); rows/s and outbox / minimal. Keeping is what each table can
   do at its cheapest: the minimal table marks its rows sent (UPDATE); the outbox moves
   them into outbox_sent with the relay's own statement (move_sent, the retention
   mode's settle, relay/sql/drain.sql).
2. The bare relay, the floor of the whole job: one Python loop that selects 2000 rows,
   produces them with the relay's producer guarantees (idempotent, acks=all, lz4,
   linger.ms 5) and its record headers (message-id, created-at), waits for every
   acknowledgement (flush, a delivery report checked per message) and deletes them (one
   write transaction a batch). Per round: on the minimal table, a `relay run` process
   at its defaults draining `outbox` (bench/cpu.py), the same loop on `outbox`; the
   order reversed in the second round. As in bench/cpu.py the first batch (producer
   and connection warm-up) is left out of the time, and CPU is the process's user +
   system time (librdkafka's threads included) per message. relay / bare relay on the
   minimal table is issue 36's figure (target >= 0.8). Last in each round, the relay at
   its defaults in retention mode (RELAY_RETENTION_SECONDS set: sent rows moved into
   outbox_sent): its rate over the delete mode's of the same round is issue 36's
   "keeping history is nearly free" (target >= 0.8). And the relay first in, first out
   (RELAY_FAIRNESS=off) on `outbox` without its key index, as lean writes run it
   (docs/howto/lean-writes.md): over the bare relay, and over the relay at its defaults.
3. The app's write path: pgbench with scripts written here (4 clients, 2 threads,
   simple protocol, no vacuum), one-row and ten-row INSERT transactions
   `INSERT INTO <table> (topic, key, payload, headers)` (200 B payload, a traceparent
   header, 100 keys) for a fixed time; then COPY of N rows in one transaction, with those
   100 keys and with a random uuid key per row (a key's index costs more the longer the
   key). Each runs outbox, bare, `outbox` without its key-hash index (the primary key
   the only index a new row enters), then `outbox` with the index sets of earlier
   releases (labelled "before 0022", "before 0015", "before 0010" as in
   docs/benchmarks.md): also outbox_due_idx, an `(id)` index of the due rows, which
   the primary key's walk replaced; then also the fair fetch's key index on whole keys
   (outbox_due_key_idx) where it has the key hash's; then also outbox_unsent_idx and
   outbox_key_idx, the unsent rows by id and by key. Then the same the other way round,
   after an untimed run on `outbox`; every run on emptied, vacuumed tables after a
   CHECKPOINT; each run is printed, so drift shows, and the ratio is of the means.

Sizes: 200,000 rows for the loops, 300,000 for the bare relay and the relay in 3
rounds, 15 s per pgbench run, 200,000 rows of COPY (--quick: 50,000, 100,000 in one
round, 5 s, 50,000).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from confluent_kafka import KafkaError, Message, Producer
from psycopg import sql

from bench import cpu
from bench.common import BARE_PRODUCER, DUE, KEYS, PAYLOAD, TOPIC, preload, produce_batch
from relay.admin.schema_options import set_key_index
from relay.drain.batch import SentRows
from relay.settings import CommonSettings
from relay.sql import QUERIES
from tests.harness.postgres import find_pg_bin

OUTBOX, MINIMAL, BARE = "outbox", "outbox_minimal", "outbox_bare"
# `outbox` with the index sets of earlier releases, each the one before plus what it
# had more (named as docs/benchmarks.md labels them): with outbox_due_idx, the due rows
# by id, which the primary key's walk replaced once dead letters and rows scheduled for
# later left the outbox; also the fair fetch's key index on whole keys
# (outbox_due_key_idx), where today's is on the key's 64-bit hash (outbox_key_hash_idx);
# also outbox_unsent_idx and outbox_key_idx, the unsent rows by id and by key, for relays
# that read neither due state. The write path's before and after in one run.
BEFORE_0022 = "outbox_before_0022"
BEFORE_0015 = "outbox_before_0015"
BEFORE_0010 = "outbox_before_0010"
# `outbox` without outbox_key_hash_idx: what the app's writes would cost with the
# primary key the only index a new row enters (docs/DESIGN.md "The indexes an insert
# pays for").
WITHOUT_KEY_INDEX = "outbox_without_key_index"
DUE_IDS: LiteralString = "(id) WHERE " + DUE  # outbox_due_idx
WHOLE_KEYS: LiteralString = "(key, id) WHERE " + DUE  # outbox_due_key_idx
# outbox_unsent_idx and outbox_key_idx: partial on "not sent, not a dead letter", which
# every row of today's outbox is (it holds only rows still to send), so whole: every new
# row enters them, as it did then.
RETIRED = ("(id)", "(key, id)")
BEFORE = {
    WITHOUT_KEY_INDEX: (),
    BEFORE_0022: (DUE_IDS,),
    BEFORE_0015: (DUE_IDS, WHOLE_KEYS),
    BEFORE_0010: (DUE_IDS, WHOLE_KEYS, *RETIRED),
}
# What "unsent" is in each table: on `outbox`, every row is; the drain takes those not
# scheduled for later (or let in), in id order by the primary key (as bench/drain.py's
# raw loop); on the minimal table, the predicate of its one partial index.
UNSENT: dict[str, LiteralString] = {
    OUTBOX: DUE,
    MINIMAL: "sent_at IS NULL",
}
RAW_BATCHES = (2000, 500)
RELAY_BATCH = 2000
CLIENTS, THREADS = 4, 2
HEADERS = '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
# The relay's `created-at` header, made in the query as the relay's fetch makes it.
CREATED_AT: LiteralString = (
    "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
)

Conn = psycopg.Connection[tuple[Any, ...]]


def _sizes(quick: bool) -> tuple[int, int, int, int]:
    """(rows per raw loop, rows for the bare relay and the relay, pgbench seconds,
    COPY rows)."""
    return (50_000, 100_000, 5, 50_000) if quick else (200_000, 300_000, 15, 200_000)


# --- tables ------------------------------------------------------------------------


def create_tables(conn: Conn) -> None:
    for table, definitions in BEFORE.items():
        before = sql.Identifier(table)
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(before))
        conn.execute(sql.SQL("CREATE TABLE {} (LIKE outbox INCLUDING ALL)").format(before))
        hashed = conn.execute(
            "SELECT quote_ident(indexname) FROM pg_indexes"
            " WHERE tablename = %s AND indexdef LIKE '%%outbox_key_hash%%'",
            (table,),
        ).fetchall()
        for (index,) in hashed if table == WITHOUT_KEY_INDEX or WHOLE_KEYS in definitions else ():
            # Without the key index, or with it on whole keys: the key-hash index goes.
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.SQL(index)))
        for definition in definitions:
            conn.execute(sql.SQL("CREATE INDEX ON {} " + definition).format(before))
    for table in (MINIMAL, BARE):
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
    # The outbox's columns, whatever the schema makes them (12 now), a primary key only.
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY, PRIMARY KEY (id))"
        ).format(sql.Identifier(BARE))
    )
    # Only what the loops read and write, typed and defaulted as the outbox's.
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} ("
            " id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " message_id uuid NOT NULL DEFAULT gen_random_uuid(),"
            " topic text NOT NULL,"
            " key text,"
            " payload bytea,"
            " headers jsonb,"
            " created_at timestamptz NOT NULL DEFAULT now(),"
            " attempts integer NOT NULL DEFAULT 0,"
            " sent_at timestamptz)"
        ).format(sql.Identifier(MINIMAL))
    )
    conn.execute(
        sql.SQL("CREATE INDEX outbox_minimal_unsent_idx ON {} (id) WHERE {}").format(
            sql.Identifier(MINIMAL), sql.SQL(UNSENT[MINIMAL])
        )
    )


def drop_tables(conn: Conn) -> None:
    for table in (MINIMAL, BARE, *BEFORE):
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


def indexes(conn: Conn, table: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_index WHERE indrelid = to_regclass(%s)", (table,)
    ).fetchone()
    return 0 if row is None else int(row[0])


def fresh(conn: Conn) -> None:
    """Empty, vacuumed tables and a checkpoint just taken: every write-path run starts
    from the same state (the same full-page images after the checkpoint, no checkpoint
    due in the middle of a short run)."""
    conn.execute(
        sql.SQL("TRUNCATE {}").format(
            sql.SQL(", ").join(sql.Identifier(t) for t in (OUTBOX, MINIMAL, BARE, *BEFORE))
        )
    )
    for table in (OUTBOX, MINIMAL, BARE, *BEFORE):
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
    conn.execute("CHECKPOINT")


# --- 1. raw loops ------------------------------------------------------------------


def raw_loop(dsn: str, table: str, batch: int, *, settle_as: SentRows) -> float:
    """rows/s of a bare loop over a pre-loaded `table`: select a batch of unsent rows by
    id, then delete it, mark it sent where it is, or (the outbox only) move it into
    outbox_sent with the relay's own statement; one transaction a batch."""
    name = sql.Identifier(table)
    fetch = sql.SQL(
        "SELECT id, message_id, topic, key, payload, headers, created_at, attempts"
        " FROM {} WHERE {} ORDER BY id LIMIT %(limit)s"
    ).format(name, sql.SQL(UNSENT[table]))
    settle: sql.Composable
    if settle_as == "delete":
        settle = sql.SQL("DELETE FROM {} WHERE id = ANY(%(ids)s::bigint[])").format(name)
    elif settle_as == "mark":  # marked in place, as an own table's retention mode does
        assert table == MINIMAL, "the outbox keeps no sent row"
        settle = sql.SQL(
            "UPDATE {} SET sent_at = now() WHERE id = ANY(%(ids)s::bigint[]) AND sent_at IS NULL"
        ).format(name)
    else:
        assert table == OUTBOX, "only the outbox has a history table"
        settle = sql.SQL(QUERIES.move_sent)
    with psycopg.connect(dsn, autocommit=True) as conn:
        total = 0
        started = time.perf_counter()
        while True:
            with conn.transaction():
                rows = conn.execute(fetch, {"limit": batch}).fetchall()
                if not rows:
                    break
                conn.execute(settle, {"ids": [r[0] for r in rows]})
            total += len(rows)
        return total / (time.perf_counter() - started)


def raw_loops(dsn: str, rows: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    cells = [(batch, mode) for batch in RAW_BATCHES for mode in ("keep", "delete")]
    for n, (batch, mode) in enumerate(cells):
        rates: dict[str, float] = {}
        order = (MINIMAL, OUTBOX) if n % 2 == 0 else (OUTBOX, MINIMAL)  # drift hits both
        for table in order:
            preload(dsn, rows, table=table)
            # Keeping history: a minimal table marks its rows sent; the outbox moves
            # them into outbox_sent, as the relay does in retention mode.
            settle_as: SentRows = (
                "delete" if mode == "delete" else "mark" if table == MINIMAL else "move"
            )
            rates[table] = raw_loop(dsn, table, batch, settle_as=settle_as)
        results.append(
            {
                "mode": mode,
                "batch": batch,
                "rows": rows,
                "first": order[0],
                "minimal": rates[MINIMAL],
                "outbox": rates[OUTBOX],
                "ratio": rates[OUTBOX] / rates[MINIMAL],
            }
        )
    return results


# --- 2. the bare relay -------------------------------------------------------------


def bare_relay(dsn: str, bootstrap: str, table: str, rows: int) -> dict[str, float]:
    """Drain `rows` pre-loaded rows of `table` with the simplest correct relay: select a
    batch, produce it, wait for every acknowledgement, delete it."""
    preload(dsn, rows, table=table)
    name = sql.Identifier(table)
    fetch = sql.SQL(
        "SELECT id, message_id::text, topic, key, payload, {}"
        " FROM {} WHERE {} ORDER BY id LIMIT %(limit)s"
    ).format(sql.SQL(CREATED_AT), name, sql.SQL(UNSENT[table]))
    delete = sql.SQL("DELETE FROM {} WHERE id = ANY(%(ids)s::bigint[])").format(name)
    producer = Producer({"bootstrap.servers": bootstrap, **BARE_PRODUCER})
    producer.produce(TOPIC, PAYLOAD, key="warm-up")  # the producer id, before the clock
    producer.flush(10)
    failed: list[str] = []

    def report(error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            failed.append(error.str())

    timed = 0
    started = cpu_started = 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        first = True
        while True:
            batch = conn.execute(fetch, {"limit": RELAY_BATCH}).fetchall()
            if not batch:
                break
            left = produce_batch(producer, batch, report)
            assert left == 0 and not failed, f"{left} undelivered, failures: {failed[:3]}"
            conn.execute(delete, {"ids": [r[0] for r in batch]})
            if first:  # as bench/cpu.py: timed from the first settled batch on
                first = False
                started, cpu_started = time.perf_counter(), time.process_time()
            else:
                timed += len(batch)
        elapsed = time.perf_counter() - started
        cpu_used = time.process_time() - cpu_started
    return {
        "rows": timed,
        "rows_per_s": timed / elapsed,
        "cpu_us_per_msg": 1e6 * cpu_used / timed,
    }


FLOOR_WAYS = (
    "bare_minimal",
    "relay",
    "bare_outbox",
    "relay_batch_2000",
    "relay_keep",
    "relay_in_order",
)


def relay_floor(dsn: str, bootstrap: str, rows: int, rounds: int) -> dict[str, Any]:
    """Per round: the bare relay on the minimal table, the relay at its defaults (delete
    mode) on `outbox`, the bare relay on `outbox`, the relay at the bare relay's batch
    of 2000, the relay at its defaults in retention mode, the relay first in, first out
    (RELAY_FAIRNESS=off) without the key index; the order reversed every other round.
    Figures: each way's mean over the rounds, and each round's ratios."""
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in FLOOR_WAYS}
    for n in range(rounds):
        for way in FLOOR_WAYS if n % 2 == 0 else FLOOR_WAYS[::-1]:
            if way == "relay":
                runs[way].append(cpu.drain(dsn, bootstrap, rows))
            elif way == "relay_batch_2000":  # the bare relay's batch
                runs[way].append(cpu.drain(dsn, bootstrap, rows, RELAY_BATCH_SIZE="2000"))
            elif way == "relay_keep":  # retention mode: sent rows kept in outbox_sent
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("TRUNCATE outbox_sent")  # each run over an empty history
                runs[way].append(cpu.drain(dsn, bootstrap, rows, RELAY_RETENTION_SECONDS="86400"))
            elif way == "relay_in_order":  # lean writes: docs/howto/lean-writes.md
                runs[way].append(_in_order(dsn, bootstrap, rows))
            else:
                table = MINIMAL if way == "bare_minimal" else OUTBOX
                runs[way].append(bare_relay(dsn, bootstrap, table, rows))
    report: dict[str, Any] = {"rows": rows, "batch": RELAY_BATCH, "rounds": rounds}
    for way, figures in runs.items():
        report[way] = {
            "runs": figures,
            "rows_per_s": statistics.mean(f["rows_per_s"] for f in figures),
            "cpu_us_per_msg": statistics.mean(f["cpu_us_per_msg"] for f in figures),
        }
    for name, way, base in (
        ("ratio", "relay", "bare_minimal"),
        ("ratio_to_bare_outbox", "relay", "bare_outbox"),
        ("ratio_batch_2000", "relay_batch_2000", "bare_minimal"),
        ("keep_to_delete", "relay_keep", "relay"),
        ("in_order_ratio", "relay_in_order", "bare_minimal"),
        ("in_order_to_fair", "relay_in_order", "relay"),
    ):
        report[name] = report[way]["rows_per_s"] / report[base]["rows_per_s"]
        report[name + "_per_round"] = [
            r["rows_per_s"] / b["rows_per_s"] for r, b in zip(runs[way], runs[base], strict=True)
        ]
    # CPU per message, the relay's process over the bare loop's (issue 48: <= 1.3).
    for name, way in (("cpu_ratio", "relay"), ("cpu_ratio_batch_2000", "relay_batch_2000")):
        report[name] = report[way]["cpu_us_per_msg"] / report["bare_minimal"]["cpu_us_per_msg"]
        report[name + "_per_round"] = [
            r["cpu_us_per_msg"] / b["cpu_us_per_msg"]
            for r, b in zip(runs[way], runs["bare_minimal"], strict=True)
        ]
    return report


def _in_order(dsn: str, bootstrap: str, rows: int) -> dict[str, float]:
    """`relay run` with RELAY_FAIRNESS=off on `outbox` without its key index (dropped
    for the run, built again after it: the other ways read it)."""
    settings = CommonSettings(database_url=dsn)
    set_key_index(settings, False)
    try:
        return cpu.drain(dsn, bootstrap, rows, RELAY_FAIRNESS="off")
    finally:
        set_key_index(settings, True)


# --- 3. the app's write path -------------------------------------------------------


def _insert(table: str, key: str) -> str:
    """One pgbench INSERT of a row like the app's: a 200 B payload, a header."""
    payload = "\\x" + PAYLOAD.hex()
    return (  # a pgbench script's line, of this module's constants only
        f"INSERT INTO {table} (topic, key, payload, headers)"
        f" VALUES ('{TOPIC}', {key}, '{payload}'::bytea, '{HEADERS}'::jsonb);\n"
    )


def scripts(directory: Path, table: str) -> dict[str, Path]:
    """pgbench scripts for `table`: one row a transaction, and ten."""
    one = directory / f"{table}-1.sql"
    one.write_text(f"\\set k random(0, {KEYS - 1})\n" + _insert(table, "'k' || :k"))
    ten = directory / f"{table}-10.sql"
    ten.write_text(
        f"\\set k random(0, {KEYS - 1})\nBEGIN;\n"
        + "".join(_insert(table, f"'k' || ((:k + {n}) % {KEYS})") for n in range(10))
        + "END;\n"
    )
    return {"one_row": one, "ten_rows": ten}


def pgbench(dsn: str, script: Path, seconds: int) -> float:
    """Transactions/s of `script` run by CLIENTS clients for `seconds`."""
    done = subprocess.run(
        [
            str(find_pg_bin() / "pgbench"),
            *("-n", "-c", str(CLIENTS), "-j", str(THREADS), "-T", str(seconds)),
            *("-f", str(script), dsn),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    failed = re.search(r"number of failed transactions: (\d+)", done.stdout)
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or tps is None or (failed is not None and int(failed[1]) > 0):
        raise RuntimeError(f"pgbench failed:\n{done.stdout}\n{done.stderr}")
    return float(tps[1])


def copy_data(rows: int, *, uuid_keys: bool = False) -> bytes:
    """`rows` lines of COPY text: topic, key (one of KEYS, or a random uuid), payload
    (bytea hex, its backslash escaped), headers."""
    payload = "\\\\x" + PAYLOAD.hex()
    return "".join(
        f"{TOPIC}\t{uuid.uuid4() if uuid_keys else f'k{n % KEYS}'}\t{payload}\t{HEADERS}\n"
        for n in range(rows)
    ).encode()


def copy_rate(dsn: str, table: str, data: bytes, rows: int) -> float:
    """rows/s of one COPY of `data` into `table`, committed."""
    statement = sql.SQL("COPY {} (topic, key, payload, headers) FROM STDIN").format(
        sql.Identifier(table)
    )
    view = memoryview(data)
    chunk = 1 << 20
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        with conn.cursor().copy(statement) as copy:
            for at in range(0, len(view), chunk):
                copy.write(view[at : at + chunk])
        conn.commit()
        return rows / (time.perf_counter() - started)


def write_path(dsn: str, seconds: int, copy_rows: int) -> dict[str, Any]:
    """outbox, bare and the variants of `outbox` (BEFORE), then the other way round,
    for each way of writing: each run's figure."""
    tables = (OUTBOX, BARE, *BEFORE)
    order = (*tables, *reversed(tables))
    report: dict[str, Any] = {"clients": CLIENTS, "threads": THREADS, "seconds": seconds}
    with psycopg.connect(dsn, autocommit=True) as conn, tempfile.TemporaryDirectory() as tmp:
        written = {table: scripts(Path(tmp), table) for table in tables}
        for way in ("one_row", "ten_rows"):
            # Untimed first, as long as a run: the series' first run, cold, read a
            # sixth lower than the same table's run in the second half.
            fresh(conn)
            pgbench(dsn, written[OUTBOX][way], seconds)
            runs: list[dict[str, Any]] = []
            for table in order:
                fresh(conn)
                tps = pgbench(dsn, written[table][way], seconds)
                runs.append({"table": table, "tps": tps})
            report[way] = _summary(runs, "tps")
        for way, uuid_keys in (("copy", False), ("copy_uuid_keys", True)):
            data = copy_data(copy_rows, uuid_keys=uuid_keys)
            fresh(conn)
            copy_rate(dsn, OUTBOX, data, copy_rows)  # untimed, as above
            runs = []
            for table in order:
                fresh(conn)
                rate = copy_rate(dsn, table, data, copy_rows)
                runs.append({"table": table, "rows_per_s": rate})
            report[way] = {"rows": copy_rows, **_summary(runs, "rows_per_s")}
        fresh(conn)
    return report


def _summary(runs: list[dict[str, Any]], field: str) -> dict[str, Any]:
    def mean(table: str) -> float:
        return float(statistics.mean(r[field] for r in runs if r["table"] == table))

    bare = mean(BARE)
    return {
        "runs": runs,
        "outbox": mean(OUTBOX),
        "bare": bare,
        "ratio": mean(OUTBOX) / bare,
        **{f"ratio_{table.removeprefix('outbox_')}": mean(table) / bare for table in BEFORE},
    }


# --- the section -------------------------------------------------------------------


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    raw_rows, relay_rows, seconds, copy_rows = _sizes(quick)
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_tables(conn)
        counts = {table: indexes(conn, table) for table in (OUTBOX, MINIMAL, BARE, *BEFORE)}
    try:
        print(
            f"\n14. baselines (issue 36): `outbox` ({counts[OUTBOX]} indexes) against a"
            f" minimal table ({counts[MINIMAL]}: primary key, (id) WHERE {UNSENT[MINIMAL]})"
            f" and a bare one ({counts[BARE]}: primary key) with the outbox's columns",
            flush=True,
        )
        loops = raw_loops(dsn, raw_rows)
        _print_loops(raw_rows, loops)
        floor = relay_floor(dsn, bootstrap, relay_rows, 1 if quick else 3)
        _print_floor(floor)
        writes = write_path(dsn, seconds, copy_rows)
        _print_writes(writes)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            drop_tables(conn)
            conn.execute("TRUNCATE outbox, outbox_sent")
    return {
        "indexes": counts,
        "raw_loops": loops,
        "relay_floor": floor,
        "write_path": writes,
    }


def _print_loops(rows: int, loops: list[dict[str, Any]]) -> None:
    print(
        f"    raw loops, {rows:,} rows of 200 B each, select a batch then keep (minimal: mark;"
        " outbox: move to outbox_sent) or delete it, one transaction a batch:"
    )
    print(f"    {'loop':>7} {'batch':>6} {'minimal rows/s':>15} {'outbox rows/s':>14} {'ratio':>6}")
    for r in loops:
        print(
            f"    {r['mode']:>7} {r['batch']:>6} {r['minimal']:>15,.0f} {r['outbox']:>14,.0f}"
            f" {r['ratio']:>6.2f}",
            flush=True,
        )


def _print_floor(floor: dict[str, Any]) -> None:
    print(
        f"    the job's floor, {floor['rows']:,} rows, {floor['rounds']} round(s): the bare"
        f" relay (select {floor['batch']}; produce: idempotent, acks=all, lz4, linger 5 ms;"
        " flush; delete) against `relay run` at its defaults; each run rows/s @ µs/msg:"
    )
    for way, label in (
        ("bare_minimal", "bare relay, minimal table"),
        ("relay", "relay at its defaults, outbox"),
        ("bare_outbox", "bare relay, outbox"),
        ("relay_batch_2000", "relay at batch 2000, outbox"),
        ("relay_keep", "relay at its defaults, keeping"),
        ("relay_in_order", "relay, off, no key index"),
    ):
        figures = floor[way]
        runs = "  ".join(
            f"{r['rows_per_s']:>9,.0f} @ {r['cpu_us_per_msg']:.2f}" for r in figures["runs"]
        )
        print(
            f"    {label:>30}: {runs}  -> {figures['rows_per_s']:,.0f} rows/s",
            flush=True,
        )

    def rounds(name: str) -> str:
        return ", ".join(f"{x:.2f}" for x in floor[name + "_per_round"])

    print(
        f"    relay / bare relay: {floor['ratio']:.2f} (rounds: {rounds('ratio')};"
        " issue 36's target >= 0.8); relay / the bare relay on outbox:"
        f" {floor['ratio_to_bare_outbox']:.2f} ({rounds('ratio_to_bare_outbox')});"
        f" the relay at batch 2000 / bare relay: {floor['ratio_batch_2000']:.2f}"
        f" ({rounds('ratio_batch_2000')})",
        flush=True,
    )
    print(
        f"    CPU per message, relay / bare relay: {floor['cpu_ratio']:.2f}"
        f" (rounds: {rounds('cpu_ratio')}; issue 48's target <= 1.3); at batch 2000:"
        f" {floor['cpu_ratio_batch_2000']:.2f} ({rounds('cpu_ratio_batch_2000')})",
        flush=True,
    )
    print(
        "    retention mode (RELAY_RETENTION_SECONDS=86400: sent rows moved into"
        f" outbox_sent) / delete mode, the relay at its defaults: {floor['keep_to_delete']:.2f}"
        f" (rounds: {rounds('keep_to_delete')}; issue 36's target >= 0.8)",
        flush=True,
    )
    print(
        "    lean writes (RELAY_FAIRNESS=off, outbox_key_hash_idx dropped) / bare relay:"
        f" {floor['in_order_ratio']:.2f} (rounds: {rounds('in_order_ratio')}); / the relay"
        f" at its defaults: {floor['in_order_to_fair']:.2f} ({rounds('in_order_to_fair')})",
        flush=True,
    )


def _print_writes(writes: dict[str, Any]) -> None:
    print(
        f"    the app's write path, pgbench {writes['clients']} clients {writes['threads']}"
        f" threads, {writes['seconds']} s a run, in this order:"
    )
    for way, label, unit in (
        ("one_row", "one-row INSERT tx", "tps"),
        ("ten_rows", "ten-row INSERT tx", "tps"),
        ("copy", f"COPY {writes['copy']['rows']:,} rows", "rows_per_s"),
        ("copy_uuid_keys", "... with uuid keys", "rows_per_s"),
    ):
        figures = writes[way]
        runs = "  ".join(
            f"{r['table'].removeprefix('outbox_')} {r[unit]:,.0f}" for r in figures["runs"]
        )
        print(
            f"    {label:>21} ({'tps' if unit == 'tps' else 'rows/s'}): {runs}"
            f"  -> outbox / bare {figures['ratio']:.2f}"
            f" (without the key index: {figures['ratio_without_key_index']:.2f},"
            f" before 0022: {figures['ratio_before_0022']:.2f},"
            f" before 0015: {figures['ratio_before_0015']:.2f},"
            f" before 0010: {figures['ratio_before_0010']:.2f})",
            flush=True,
        )
