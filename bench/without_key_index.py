"""Without the key index: what a fair fetch would cost if the outbox's primary key were
the only index a new row enters (issue 36, docs/DESIGN.md "The indexes an insert pays
for"). A sketch, measured, not the relay.

    ./dev bench --only without-key-index [--quick]

The app's COPY runs at 0.96-0.99 of a bare table without `outbox_key_hash_idx`
and 0.78-0.80 with it (bench/baselines.py). Without it, the only way past a key's backlog is
to move that backlog out of the outbox: rows a full head cannot send now go into a
table of the relay's own that has a key index, and come out of it by key. This module
runs that design as one Python loop, the bare relay's (bench/baselines.py: select,
produce with the relay's producer guarantees, wait for every ack, delete), on a table
with the outbox's columns and only a primary key (`lean_outbox`) and a side table
(`lean_crowded`, primary key and `(key, id)`):

1. the head: the first BATCH rows by id; a row is blocked if its key has a row with a
   lower id in the side table;
2. the side table's keys, by a loose index scan, each its share of BATCH;
3. every key's first CAP rows first (the head's and the side table's, in id order),
   then more rows of busy keys, up to BATCH (as the relay over Kafka);
4. if the head was full and a key had more than CAP rows in it, or rows were blocked:
   those keys' rows among the first `window` rows by id, but for the ones chosen, move
   into the side table (DELETE ... RETURNING into INSERT);
5. produce the chosen rows, flush, delete them from both tables.

Each move takes every row of its keys that it can see in its window, and a key's later
rows have higher ids, so a key's rows go in id order as long as the app serializes its
writes per key (the relay's own condition for its order promise): a row that commits
late below a moved one could otherwise be passed. The round over the side table's keys
always starts at the first key (the relay's goes on from where the last one stopped):
with more crowded keys than a batch holds, the last ones would wait. Neither happens
here.

The ways, on the same table, alternating: `sketch` (a move reaches 4 batches by id),
`sketch_wide` (16), `sketch_skip_alone` (4, but no move for 100 ms after a batch that
is all one key with no other key in the side table, as the relay skips its sharing
while a key drains alone; without the key index the loop cannot tell a key alone from
one in front of others, so this is close to FIFO with a move now and then), and `fifo`
(steps 1 and 5 only). The scenarios:
- hot: ROWS rows of one key in front; once it flows, 250 rows of 50 other keys are
  committed: how long until they are all delivered, and how many rows were then still
  to go; how many rows were moved, and the whole drain's rate;
- skewed: ROWS rows, a third of them of one key, the rest over 100 keys;
- even: ROWS rows over 100 keys (nothing should move).
Then the relay itself (its fair fetch, with the key index) on `outbox`, the hot
scenario (bench/fairness.py's). The loop is serial (the relay is pipelined): compare
the ways with each other, and the relay's "others delivered" figure with theirs only
roughly.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any, LiteralString

import psycopg
from confluent_kafka import KafkaError, Message, Producer

from bench import fairness
from bench.common import BARE_PRODUCER, KEYS, PAYLOAD, TOPIC, produce_batch
from bench.processes import wait_for

BATCH = 1000
CAP = BATCH // 5  # the relay's RELAY_BATCH_MAX_PER_KEY over Kafka
# Rows by id a move may reach, by way: the head advances by up to this much a fetch.
WINDOWS = {"sketch": 4 * BATCH, "sketch_wide": 16 * BATCH, "sketch_skip_alone": 4 * BATCH}
ALONE_SECONDS = 0.1
OTHERS, PER_OTHER = fairness.OTHERS, fairness.PER_OTHER

Conn = psycopg.Connection[tuple[Any, ...]]

# A row as bench/common.py's produce_batch takes it (the bare relay's), then `blocked`.
COLUMNS: LiteralString = "id, message_id::text, topic, key, payload, created_at::text"
KEY, BLOCKED = 3, 6

# Blocked: the key has a lower id in the side table. Looked for downwards from the row's
# id (a scalar subquery: an EXISTS would drop the order): the key's rows sent from the
# side table lie dead at the low end of its index until a vacuum, and an upward walk from
# there crossed all of them for every row, a second a fetch at 30,000 moved.
HEAD: LiteralString = (
    "SELECT " + COLUMNS + ","
    " (SELECT max(c.id) FROM lean_crowded AS c) IS NOT NULL AND ("
    "   SELECT c.id FROM lean_crowded AS c WHERE c.key = o.key AND c.id < o.id"
    "   ORDER BY c.key DESC, c.id DESC LIMIT 1) IS NOT NULL AS blocked"
    " FROM lean_outbox AS o ORDER BY o.id LIMIT %(batch)s"
)
# The side table's keys, one descent each, and each key's share of the batch.
CROWDED: LiteralString = (
    "WITH RECURSIVE keys (key) AS ("
    "   SELECT min(key) FROM lean_crowded"
    "   UNION ALL"
    "   SELECT (SELECT min(c.key) FROM lean_crowded AS c WHERE c.key > keys.key)"
    "   FROM keys WHERE keys.key IS NOT NULL),"
    " round AS (SELECT key FROM keys WHERE key IS NOT NULL LIMIT %(batch)s)"
    " SELECT p.id, p.message_id::text, p.topic, p.key, p.payload, p.created_at::text, false"
    " FROM round CROSS JOIN LATERAL ("
    "   SELECT * FROM lean_crowded AS c WHERE c.key = round.key ORDER BY c.id"
    "   LIMIT (SELECT greatest(1, %(batch)s / count(*)) FROM round)) AS p"
)
# The window's ids first, as an array: the DELETE then probes the primary key by id (as
# a join, the planner read the whole table to match 4,000 ids).
MOVE: LiteralString = (
    "WITH gone AS ("
    "   DELETE FROM lean_outbox AS o"
    "   WHERE o.id = ANY(ARRAY("
    "     SELECT w.id FROM (SELECT id, key FROM lean_outbox ORDER BY id LIMIT %(window)s) AS w"
    "     WHERE w.key = ANY(%(keys)s::text[]) AND w.id <> ALL(%(chosen)s::bigint[])))"
    "   RETURNING o.*)"
    " INSERT INTO lean_crowded SELECT * FROM gone"
)
SETTLE: tuple[LiteralString, LiteralString] = (
    "DELETE FROM lean_outbox WHERE id = ANY(%(ids)s::bigint[])",
    "DELETE FROM lean_crowded WHERE id = ANY(%(ids)s::bigint[])",
)


def create_tables(conn: Conn) -> None:
    drop_tables(conn)
    conn.execute(
        "CREATE TABLE lean_outbox (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY,"
        " PRIMARY KEY (id))"
    )
    conn.execute("CREATE TABLE lean_crowded (LIKE outbox INCLUDING DEFAULTS, PRIMARY KEY (id))")
    conn.execute("CREATE INDEX lean_crowded_key_idx ON lean_crowded (key, id)")


def drop_tables(conn: Conn) -> None:
    conn.execute("DROP TABLE IF EXISTS lean_outbox, lean_crowded")


def _choose(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Step 3: every key's first CAP rows, then more of busy keys, BATCH at most; each
    key a prefix of its rows (places in id order), in id order."""
    rows = sorted(rows, key=lambda r: r[0])
    seen: Counter[str] = Counter()
    placed = []
    for row in rows:
        seen[row[KEY]] += 1
        placed.append((seen[row[KEY]] > CAP, seen[row[KEY]], row[0], row))
    placed.sort(key=lambda p: p[:3])
    return sorted((p[3] for p in placed[:BATCH]), key=lambda r: r[0])


# The loops compared: the sketch moving at every crowded fetch (two windows), the
# sketch that stops moving for ALONE_SECONDS while one key seems to drain alone, and
# first in, first out.
WAYS = ("sketch", "sketch_wide", "sketch_skip_alone", "fifo")


class Loop:
    """One of WAYS, draining until stopped; counts what it delivered and moved, and
    when the others' rows were all delivered."""

    def __init__(self, dsn: str, bootstrap: str, way: str) -> None:
        self.dsn, self.fair, self.skip_alone = dsn, way != "fifo", way == "sketch_skip_alone"
        self.window = WINDOWS.get(way, 0)
        self.producer = Producer({"bootstrap.servers": bootstrap, **BARE_PRODUCER})
        self.delivered = 0
        self.moved = 0
        self.others_left = OTHERS * PER_OTHER
        self.others_done = threading.Event()
        self.left_then = 0  # rows not yet delivered when the others' last one was
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.failed: list[str] = []
        self._alone_until = 0.0
        self.expected = 0  # rows the drain will deliver in all (set by the caller)

    def _report(self, error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            self.failed.append(error.str())

    def _fetch(self, conn: Conn) -> list[tuple[Any, ...]]:
        head = conn.execute(HEAD, {"batch": BATCH}).fetchall()
        if not self.fair:
            return [r[:BLOCKED] for r in head]
        ready = [r for r in head if not r[BLOCKED]]
        crowded = conn.execute(CROWDED, {"batch": BATCH}).fetchall() if self.moved else []
        counts = Counter(r[KEY] for r in ready)
        busy = {k for k, n in counts.items() if n > CAP} | {r[KEY] for r in head if r[BLOCKED]}
        if not crowded and not busy:
            return [r[:BLOCKED] for r in ready]  # the usual head: nothing to share out
        chosen = _choose([r[:BLOCKED] for r in ready] + [r[:BLOCKED] for r in crowded])
        if len(head) == BATCH and busy:
            alone = len({r[KEY] for r in chosen}) == 1 and {r[KEY] for r in crowded} <= {
                r[KEY] for r in chosen
            }
            now = time.monotonic()
            if self.skip_alone and alone:
                if now < self._alone_until:
                    return chosen
                self._alone_until = now + ALONE_SECONDS
            cur = conn.execute(
                MOVE,
                {"window": self.window, "keys": sorted(busy), "chosen": [r[0] for r in chosen]},
            )
            self.moved += cur.rowcount
        return chosen

    def run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # seen by the waiting side, which stops at once
            self.error = exc
            self.others_done.set()
            raise

    def pending(self, total: int) -> bool:
        if self.error is not None:
            raise RuntimeError("bench: the loop failed") from self.error
        return self.delivered < total

    def _drain(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            # Every statement here is an index walk or probe, as the drain's session plans
            # them (relay/sql/drain.sql, walk_indexes_in_order): the side table grows from
            # empty far past what its statistics saw.
            conn.execute("SET plan_cache_mode = force_custom_plan")
            conn.execute("SET enable_seqscan = off")
            conn.execute("SET enable_bitmapscan = off")
            while not self.stop.is_set():
                with conn.transaction():
                    batch = self._fetch(conn)
                if not batch:
                    time.sleep(0.005)
                    continue
                left = produce_batch(self.producer, batch, self._report)
                assert left == 0 and not self.failed, f"{left} undelivered: {self.failed[:3]}"
                ids = [r[0] for r in batch]
                with conn.transaction():
                    for statement in SETTLE:
                        conn.execute(statement, {"ids": ids})
                self.delivered += len(batch)
                others = sum(1 for r in batch if r[KEY].startswith("o"))
                if others:
                    self.others_left -= others
                    if self.others_left <= 0:
                        self.left_then = self.expected - self.delivered
                        self.others_done.set()


# The scenarios: one hot key (the others' rows come once it flows), a skewed mix (a
# third of the rows on one key, the rest over KEYS keys), and KEYS keys evenly.
SCENARIOS = ("hot", "skewed", "even")


def _load(dsn: str, scenario: str, rows: int) -> None:
    key = {
        "hot": "'H'",
        "skewed": "CASE WHEN g %% 3 = 0 THEN 'H' ELSE 'k' || (g %% %(keys)s) END",
        "even": "'k' || (g %% %(keys)s)",
    }[scenario]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE lean_outbox, lean_crowded")
        conn.execute(
            "INSERT INTO lean_outbox (topic, key, payload) SELECT %(topic)s, " + key + ","
            " %(payload)s FROM generate_series(1, %(rows)s) AS g",
            {"topic": TOPIC, "keys": KEYS, "payload": PAYLOAD, "rows": rows},
        )
        conn.execute("VACUUM ANALYZE lean_outbox")
        conn.execute("VACUUM ANALYZE lean_crowded")


def sketch(dsn: str, bootstrap: str, rows: int, *, scenario: str, way: str) -> dict[str, Any]:
    """One drain by a loop of WAYS of `rows` rows of a scenario; with the hot key, the
    others' rows once it flows."""
    _load(dsn, scenario, rows)
    loop = Loop(dsn, bootstrap, way)
    loop.expected = rows + (OTHERS * PER_OTHER if scenario == "hot" else 0)
    thread = threading.Thread(target=loop.run, daemon=True)
    started = time.monotonic()  # the producer's and the session's start-up included
    thread.start()
    result: dict[str, Any] = {"way": way, "scenario": scenario, "rows": rows}
    try:
        if scenario == "hot":
            wait_for(lambda: not loop.pending(1), 60, "the hot key flowing")
            with psycopg.connect(dsn, autocommit=True) as conn:
                committed = fairness.commit_others(conn, "lean_outbox")
            if not loop.others_done.wait(600):
                raise TimeoutError("bench: the other keys were never delivered")
            loop.pending(0)  # raises if the loop failed
            result["others_delivered_s"] = time.monotonic() - committed
            result["hot_rows_left_then"] = loop.left_then
        wait_for(lambda: not loop.pending(loop.expected), 600, "the drain")
        result["rows_per_s"] = loop.expected / (time.monotonic() - started)
        result["moved"] = loop.moved
    finally:
        loop.stop.set()
        thread.join(60)
    return result


def relay_hot_key(dsn: str, bootstrap: str, rows: int) -> dict[str, Any]:
    """The relay itself (its fair fetch, with the key index) on `outbox`, the same
    scenario (bench/fairness.py's)."""
    return {
        "way": "relay",
        "scenario": "hot",
        "rows": rows,
        **fairness.hot_key(dsn, bootstrap, rows),
    }


def run(dsn: str, bootstrap: str, quick: bool) -> dict[str, Any]:
    rows = 100_000 if quick else 300_000
    rounds = 1 if quick else 2
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_tables(conn)
    runs: list[dict[str, Any]] = []
    try:
        for n in range(rounds):
            for scenario in SCENARIOS:
                for way in WAYS if n % 2 == 0 else WAYS[::-1]:
                    runs.append(sketch(dsn, bootstrap, rows, scenario=scenario, way=way))
            runs.append(relay_hot_key(dsn, bootstrap, rows))
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            drop_tables(conn)
    report = {"rows": rows, "rounds": rounds, "batch": BATCH, "windows": WINDOWS, "runs": runs}
    _print(report)
    return report


def _print(report: dict[str, Any]) -> None:
    runs = report["runs"]

    def mean(way: str, scenario: str, field: str) -> float:
        return float(
            statistics.mean(r[field] for r in runs if r["way"] == way and r["scenario"] == scenario)
        )

    windows = ", ".join(f"{way} {window:,}" for way, window in report["windows"].items())
    print(
        f"\n19. without the key index (a sketch: one serial loop), {report['rows']:,} rows,"
        f" batch {report['batch']}, a move reaching this many rows by id: {windows};"
        f" {report['rounds']} round(s), each run:",
        flush=True,
    )
    for r in runs:
        parts = [f"{r['rows_per_s']:,.0f} rows/s"] if "rows_per_s" in r else []
        parts += [f"{r['moved']:,} moved"] if "moved" in r else []
        if "others_delivered_s" in r:
            parts.append(
                f"the others' rows in {r['others_delivered_s']:.2f} s"
                f" ({r['hot_rows_left_then']:,} rows left then)"
            )
        print(f"    {r['scenario']:>6} {r['way']:>17}: " + ", ".join(parts), flush=True)
    print(
        "    the others' 250 rows behind a hot key, delivered after: the relay (with the key"
        f" index) {mean('relay', 'hot', 'others_delivered_s'):.2f} s, "
        + ", ".join(f"{way} {mean(way, 'hot', 'others_delivered_s'):.2f} s" for way in WAYS),
        flush=True,
    )
    fifo = {scenario: mean("fifo", scenario, "rows_per_s") for scenario in SCENARIOS}
    for way in WAYS[:-1]:
        ratios = (f"{s} {mean(way, s, 'rows_per_s') / fifo[s]:.2f}" for s in SCENARIOS)
        print(f"    drain rate {way} / fifo: " + ", ".join(ratios), flush=True)
