"""Command line: `relay run|migrate|status|check|healthcheck|dead-letter|console|purge|replay`
and `relay pause|resume` (also `python -m relay`).

Long: one small function per command plus the argument parser that names them all; a
command's logic lives in the modules it calls (repository, lag, migrate, sinks).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

import psycopg

from relay import __version__
from relay.admin import dead_letters, pauses, replay, status, times
from relay.admin.migrate import SchemaState, schema_state
from relay.drain import fairness
from relay.errors import MigrationError
from relay.observe import lag
from relay.observe.logging import configure
from relay.settings import CommonSettings, Settings, SettingsError, load_settings
from relay.sql import QUERIES
from relay.store import connection, db, repository
from relay.store.rows import LeaseRow, ReplicaRow

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 2


def parse_duration(text: str) -> float:
    """`90`, `45s`, `30m`, `12h`, `7d` -> seconds (relay/admin/times.py)."""
    try:
        return times.duration_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_time(text: str) -> datetime | timedelta:
    """A replay's `--since`/`--until`: an instant or how long ago (relay/admin/times.py)."""
    try:
        return times.instant_or_ago(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def _print_json(value: Any) -> None:
    print(json.dumps(value, default=status.json_default, indent=2))


# --- commands ---


def cmd_run(_args: argparse.Namespace) -> int:
    from relay.daemon.app import run

    settings = load_settings(Settings)
    configure(settings.log_format, settings.log_level)
    return run(settings)


# A server bound to every address is probed on loopback.
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104


def health_url(host: str, port: int) -> str:
    host = _WILDCARDS.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/healthz"


def cmd_healthcheck(args: argparse.Namespace) -> int:
    """The container's HEALTHCHECK: GET /healthz on this replica's own metrics server,
    wherever RELAY_METRICS_HOST/PORT put it (a wildcard address is probed on loopback)."""
    settings = load_settings(Settings)
    if not settings.metrics_enabled:
        print("relay: no health endpoint (RELAY_METRICS_PORT=0): nothing to probe")
        return EXIT_OK
    url = health_url(settings.metrics_host, settings.metrics_port)
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:  # noqa: S310
            body = response.read(200).decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        detail = exc.read(200).decode(errors="replace").strip()
        print(f"relay: unhealthy: {url} answered {exc.code} {detail}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        print(f"relay: unhealthy: {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"healthy: {url} {body}")
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from relay.admin.migrate import migrate
    from relay.admin.schema_options import (
        create_fairness_index,
        create_shard_indexes,
        set_key_index,
        set_notify_trigger,
    )
    from relay.store.own_table import migrate_own_table

    if args.dry_run and not args.own_table:
        print("relay migrate: --dry-run goes with --own-table", file=sys.stderr)
        return EXIT_CONFIG
    settings = load_settings(CommonSettings)
    configure(settings.log_format, settings.log_level)
    refused = _migrate_refusal(args, settings)
    if refused is not None:
        print(f"relay migrate: {refused}", file=sys.stderr)
        return EXIT_CONFIG
    if args.dry_run:
        texts = migrate_own_table(settings, dry_run=True)
        print(f"-- relay migrate --own-table for {settings.outbox_table}: nothing applied")
        print("\n\n".join(text.rstrip(";") + ";" for text in texts))
        return EXIT_OK
    migrated = migrate(settings)
    applied = migrated.applied
    print(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))
    if migrated.waiting is not None:
        print(migrated.waiting)
    if args.own_table:
        migrate_own_table(settings)
        print(
            f"own table {settings.outbox_table}: bookkeeping columns, indexes and the view"
            f" {settings.outbox_view_schema}.outbox are in place"
        )
    if args.without_key_index or args.with_key_index:  # first: --shards follows it
        changed = set_key_index(settings, args.with_key_index)
        verb = "built" if args.with_key_index else "dropped"
        print(
            f"key index: {verb} {', '.join(changed)}"
            if changed
            else f"key index: {'already there' if args.with_key_index else 'already gone'}"
        )
    if args.shards > 1:
        built = create_shard_indexes(settings, args.shards)
        print(
            f"shard indexes for {args.shards} shards: "
            + (f"built {', '.join(built)}" if built else "already there")
        )
    if args.fairness_group is not None:
        group = args.fairness_group
        built_now = create_fairness_index(settings, group, args.shards)
        print(
            f"fairness index for {group.spec}"
            + (f" with {args.shards} shards" if args.shards > 1 else "")
            + f": {'built' if built_now else 'already there'} {group.index_name(args.shards)}"
        )
    if args.notify_trigger is not None:
        set_notify_trigger(settings, args.notify_trigger)
        print(f"notify trigger: every INSERT into outbox notifies {args.notify_trigger!r}")
    elif args.drop_notify_trigger:
        set_notify_trigger(settings, None)
        print("notify trigger: dropped")
    return EXIT_OK


def _migrate_refusal(args: argparse.Namespace, settings: CommonSettings) -> str | None:
    """Why these `relay migrate` flags do not go together with these settings, if so."""
    own_table = settings.outbox_table is not None
    if own_table and (args.without_key_index or args.with_key_index):
        return (
            "--with-key-index and --without-key-index are for the relay's own outbox; an"
            " own table's indexes are `--own-table`'s"
        )
    if args.without_key_index and args.fairness_group is not None:
        return (
            "--fairness-group builds an index for the fair fetch, which --without-key-index"
            " is for turning off"
        )
    if own_table and (args.notify_trigger or args.drop_notify_trigger):
        return (
            "the notify trigger is for the relay's own outbox; with RELAY_OUTBOX_TABLE,"
            " NOTIFY from the app or a trigger of your own"
        )
    return None


def _fairness_group(text: str) -> fairness.FairnessGroup:
    try:
        return fairness.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _channel(text: str) -> str:
    """A NOTIFY channel as RELAY_NOTIFY_CHANNEL accepts it."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: lower-case letters, digits and _, not starting with a digit"
        )
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, for people; `--json` is the format for scripts."""
    cells = [list(headers), *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )


def _count(value: int, cap: int) -> str:
    return f">= {value}" if value >= cap else str(value)


def _due_in(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{max(0.0, seconds):.1f}s"


def cmd_status(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    with db.connect(settings, purpose="status") as conn:
        found = status.read_status(conn, args.count_cap)
    if args.json:
        _print_json(found.as_json())
        return EXIT_OK
    if found.leases:
        print(_lease_table(found.leases, found.shard_lag))
    else:
        print("no lease rows yet (no relay has run)")
    if found.replicas:
        print()
        print(_replica_table(found.replicas))
    print()
    print(_outbox_table(found.sample, found.schema))
    if found.paused:
        print()
        print(_paused_table(found.paused))
    return EXIT_OK


def _paused_table(paused: Sequence[pauses.PausedTopic]) -> str:
    return _table(
        ("PAUSED TOPIC", "PAUSED BY", "SINCE", "HELD ROWS", "REASON"),
        [
            (p.topic, p.paused_by, f"{p.paused_at:%Y-%m-%d %H:%M:%S%z}", p.held_rows, p.reason)
            for p in paused
        ],
    )


def _lease_table(leases: Sequence[LeaseRow], shard_lag: status.ShardLags) -> str:
    """A SHARD column only once some lease group is sharded, and backlog columns only
    once some shard's backlog could be measured (see `status.shard_lag`)."""
    sharded = any(lease.shards > 1 for lease in leases)
    rows = []
    for lease in leases:
        shard = (f"{lease.shard}/{lease.shards}",) if sharded else ()
        backlog = _shard_backlog(lease, shard_lag) if shard_lag else ()
        rows.append(
            (
                lease.lease_group,
                *shard,
                "held" if lease.live else "free",
                lease.holder,
                lease.epoch,
                f"{lease.expires_at:%Y-%m-%d %H:%M:%S%z}",
                f"{lease.seconds_to_expiry:.1f}s" if lease.live else "expired",
                *backlog,
            )
        )
    headers = ("LEASE", *(("SHARD",) if sharded else ()), "STATE", "HOLDER", "EPOCH")
    lag_headers = ("UNSENT", "OLDEST UNSENT") if shard_lag else ()
    return _table((*headers, "EXPIRES AT", "EXPIRES IN", *lag_headers), rows)


def _shard_backlog(lease: LeaseRow, shard_lag: status.ShardLags) -> tuple[str, str]:
    """Blank where nothing was measured, or measured for another shard count than the
    lease's (a lease of an old count: its shard is not the same slice of the outbox)."""
    s = shard_lag.get((lease.lease_group, lease.shard))
    if s is None or s.shards != lease.shards:
        return ("-", "-")
    return (_count(s.unsent, s.count_cap), f"{s.oldest_unsent_age_seconds:.1f}s")


def _replica_table(replicas: Sequence[ReplicaRow]) -> str:
    return _table(
        ("LEASE", "REPLICA", "LAST SEEN", "SINK", "SINK ERROR"),
        [
            (
                r.lease_name,
                r.replica_id,
                f"{r.seconds_since_seen:.1f}s ago",
                "reachable" if r.sink_ok else "unreachable",
                r.sink_error or "",
            )
            for r in replicas
        ],
    )


def _outbox_table(sample: lag.LagSample, schema: SchemaState) -> str:
    cap = sample.count_cap
    return _table(
        ("OUTBOX", "VALUE"),
        [
            ("unsent rows", _count(sample.unsent, cap)),
            ("oldest unsent age", f"{sample.oldest_unsent_age_seconds:.1f}s"),
            ("blocked rows", _count(sample.blocked, cap)),
            ("dead-lettered rows", _count(sample.dead_lettered, cap)),
            ("scheduled rows", _count(sample.scheduled, cap)),
            ("next scheduled in", _due_in(sample.next_due_in_seconds)),
            ("schema version", schema.describe()),
        ],
    )


def cmd_check(_args: argparse.Namespace) -> int:
    from relay.sinks import create_sink

    settings = load_settings(Settings)
    # check reports in its own lines; the sink client's reconnect chatter against a dead
    # broker (hundreds of lines in the 5 s wait) would bury the one line that matters.
    configure(settings.log_format, "critical")
    print(
        f"settings: ok (sink={settings.sink}, lease={settings.lease_name},"
        f" replica={settings.replica_id})"
    )
    from relay.daemon.app import startup_warnings

    for variable, problem in startup_warnings(settings):
        print(f"settings: warning: {variable}: {problem}")
    try:
        with db.connect(settings, purpose="check") as conn:
            try:
                schema = schema_state(conn)
            except psycopg.errors.UndefinedTable:
                schema = SchemaState(None, [])
            if schema.version is None:
                print(
                    "database: FAILED: no migration applied (run `relay migrate`)", file=sys.stderr
                )
                return EXIT_FAILURE
            repository.lease_status(conn)
            # Heartbeats (the replicas table and its grants): without them the relay runs,
            # but a leader cut off from the sink never gives way.
            conn.execute(QUERIES.replica_status).fetchall()
            sample = lag.measure(conn, 1_000)
            pooled = isinstance(conn, connection.RelayConnection) and conn.pooled
            history = (
                repository.sent_history_problem(conn) if settings.sent_rows == "move" else None
            )
        if history is not None:
            print(f"database: FAILED: keeping sent rows: {history}", file=sys.stderr)
            return EXIT_FAILURE
    except psycopg.Error as exc:
        print(f"database: FAILED: {db.describe_error(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    print(
        f"database: ok (schema version {schema.describe()}; outbox, leases and replicas readable;"
        f" {_count(sample.unsent, sample.count_cap)} unsent rows"
        f"{'; through a transaction pooler' if pooled else ''})"
    )
    sink = create_sink(settings)
    try:
        print(sink.check(timeout=5.0))
    except Exception as exc:
        print(f"sink: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        sink.close()
    return EXIT_OK


def cmd_dead_letter_list(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    with db.connect(settings, purpose="dead-letter") as conn:
        rows = dead_letters.dead_letters(conn, topic=args.topic, key=args.key, limit=args.limit)
    if args.json:
        _print_json([asdict(row) for row in rows])
        return EXIT_OK
    print(
        _table(
            ("ID", "MESSAGE ID", "TOPIC", "KEY", "ATTEMPTS", "DEAD-LETTERED AT", "REASON"),
            [
                (
                    row.id,
                    row.message_id,
                    row.topic,
                    row.key,
                    row.attempts,
                    f"{row.dead_lettered_at:%Y-%m-%d %H:%M:%S%z}",
                    row.dead_letter_reason,
                )
                for row in rows
            ],
        )
    )
    more = " (more exist: raise --limit)" if len(rows) == args.limit else ""
    print(f"{len(rows)} dead-lettered row(s){more}", file=sys.stderr)
    return EXIT_OK


def cmd_dead_letter_requeue(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    with db.connect(settings, purpose="dead-letter") as conn, conn.transaction():
        ids = dead_letters.requeue_dead_letters(
            conn,
            ids=args.id or (),
            key=args.key,
            everything=args.all,
            set_aside=settings.set_aside,
        )
        overtaking = dead_letters.dead_letters_left_behind(conn, ids)
        if args.dry_run:
            raise_rollback()
    verb = "would requeue" if args.dry_run else "requeued"
    print(f"{verb} {len(ids)} row(s)" + (f": {' '.join(map(str, ids))}" if ids else ""))
    missing = sorted(set(args.id or ()) - set(ids))
    if missing:
        # Already requeued, sent, never dead-lettered, or dropped by a trigger of the
        # app's on the way back (it stays a dead letter): nothing done, but say so.
        print(f"not requeued: {' '.join(map(str, missing))}", file=sys.stderr)
    if overtaking:
        print(
            "warning: earlier dead letters of key(s) "
            + ", ".join(repr(k) for k in overtaking)
            + " stay dead-lettered; the requeued rows will be delivered before them"
            " (requeue by --key to keep per-key order)",
            file=sys.stderr,
        )
    return EXIT_OK


def raise_rollback() -> None:
    raise psycopg.Rollback


def cmd_console(_args: argparse.Namespace) -> int:
    """The operators' web console (relay/console/), imported only here: `relay run`
    never pays for the web stack."""
    try:
        from relay.console.server import serve
    except ModuleNotFoundError as exc:
        print(
            f"relay console: {exc.name} is not installed: pip install 'pg-outbox-relay[console]'",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    return serve()


def cmd_sql(args: argparse.Namespace) -> int:
    from relay.admin import statements
    from relay.sql import QUERIES

    if args.list or args.name is None:
        print(statements.listing())
        return 0
    if args.name not in QUERIES.names():
        print(
            f"relay sql: no statement named {args.name!r} (relay sql --list names them)",
            file=sys.stderr,
        )
        return 2
    print(statements.for_psql(args.name))
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    settings = load_settings(CommonSettings)
    total = 0
    with db.connect(settings, purpose="purge") as conn:
        emptied = []
        if settings.outbox_table is None:
            emptied = repository.empty_sent_generations(conn, args.older_than)
        else:  # an own table keeps its sent rows, marked
            while True:
                count = repository.purge_sent(conn, args.older_than, args.batch_size)
                total += count
                if count < args.batch_size:
                    break
    print(f"purged {total} sent row(s) older than {args.older_than:g}s")
    if emptied:
        print(
            f"emptied {len(emptied)} generation(s) of outbox_sent older than"
            f" {args.older_than:g}s: {', '.join(map(str, emptied))}"
        )
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    """Rows kept as sent back into the outbox as new rows (relay/admin/replay.py); a
    refusal (no history, a range before it, over the cap) changes nothing, exit 2."""
    settings = load_settings(CommonSettings)
    if settings.outbox_table is not None:
        print(
            "relay replay: an own table (RELAY_OUTBOX_TABLE) keeps its sent rows in place, and"
            " replay reads the relay's outbox_sent: nothing to replay",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    request = replay.Request(topic=args.topic, since=args.since, until=args.until, key=args.key)
    with db.connect(settings, purpose="replay") as conn:
        if args.dry_run:
            found = replay.count(conn, request)
        else:
            found = replay.replay(
                conn, request, max_rows=args.max_rows, actor=replay.shell_user(), via="cli"
            )
    refused = replay.refusal(found, args.max_rows)
    if refused is not None:
        print(f"relay replay: {refused}; nothing replayed", file=sys.stderr)
        return EXIT_CONFIG
    what = replay.describe(request, found)
    if found.matching == 0:
        print(f"nothing to replay: no row of {what} is kept ({replay.kept(found)})")
        return EXIT_OK
    if args.dry_run:
        print(f"would replay {found.matching} row(s) of {what}")
        return EXIT_OK
    if found.replay_id is None:  # refusal() found nothing: the function's own checks agree
        print("relay replay: nothing replayed (the database refused it)", file=sys.stderr)
        return EXIT_FAILURE
    print(
        f"replayed {found.replayed} row(s) of {what}: replay {found.replay_id}, new outbox ids"
        f" {found.first_id}-{found.last_id}, header relay-replay: {found.replay_id}"
    )
    return EXIT_OK


def cmd_pause(args: argparse.Namespace) -> int:
    """Pause a topic (relay/admin/pauses.py): its rows wait until `relay resume`."""
    problem = pauses.topic_problem(args.topic)
    if problem is not None:
        print(f"relay pause: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    settings = load_settings(CommonSettings)
    with db.connect(settings, purpose="pause") as conn:
        done = pauses.pause(
            conn, args.topic, actor=replay.shell_user(), via="cli", reason=args.reason
        )
    since = f"{done.paused_since:%Y-%m-%d %H:%M:%S%z}" if done.paused_since else "?"
    if done.done:
        print(
            f"paused topic {args.topic!r} (audit entry {done.audit_id}): its rows wait in the"
            " outbox; every relay holds them within a second or two"
        )
    else:
        print(f"topic {args.topic!r} was paused already, since {since}: nothing changed")
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Resume a paused topic: the relays let its rows go within a second or two."""
    settings = load_settings(CommonSettings)
    with db.connect(settings, purpose="pause") as conn:
        done = pauses.resume(conn, args.topic, actor=replay.shell_user(), via="cli")
    if not done.done:
        print(f"topic {args.topic!r} is not paused: nothing changed")
        return EXIT_OK
    print(
        f"resumed topic {args.topic!r} (audit entry {done.audit_id}): the relays send its"
        " rows again within a second or two, in order per key"
    )
    return EXIT_OK


# --- parser ---


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relay",
        description="Transactional outbox relay. Configuration comes from RELAY_* variables.",
    )
    parser.add_argument("--version", action="version", version=f"relay {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    add("run", cmd_run, "run the relay daemon (one replica of many)")
    _migrate_arguments(
        add("migrate", cmd_migrate, "apply pending schema migrations (safe from several replicas)")
    )
    _status_arguments(add("status", cmd_status, "show lease holder, epoch, expiry and backlog"))
    add("check", cmd_check, "validate settings and connect to the database and the sink")
    health = add("healthcheck", cmd_healthcheck, "probe this replica's /healthz (for Docker)")
    health.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="SECONDS",
        help="how long to wait for /healthz to answer; no answer in time is unhealthy",
    )
    _dead_letter_commands(sub.add_parser("dead-letter", help="list or requeue dead-lettered rows"))
    add("console", cmd_console, "serve the operators' web console (RELAY_CONSOLE_* settings)")
    statement = add(
        "sql", cmd_sql, "print the SQL statements the relay runs, ready to paste into psql"
    )
    statement.add_argument(
        "--list", action="store_true", help="name every statement (the default with no NAME)"
    )
    statement.add_argument(
        "name", nargs="?", metavar="NAME", help="print this statement, fragments filled in"
    )
    purge = add("purge", cmd_purge, "delete sent rows older than a duration, in small batches")
    purge.add_argument(
        "--older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="purge rows sent longer ago than this: 90 (seconds), 45s, 30m, 12h, 7d",
    )
    purge.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1000,
        help="delete the sent rows kept in the outbox itself (an own table's) this many at"
        " a time, each batch its own short transaction; outbox_sent is emptied a generation"
        " at a time",
    )
    paused = add(
        "pause", cmd_pause, "hold a topic's rows in the outbox (unsent) until `relay resume`"
    )
    paused.add_argument("topic", metavar="TOPIC", help="the topic (exact)")
    paused.add_argument("--reason", help="why, for the audit trail and `relay status`")
    resumed = add("resume", cmd_resume, "let a paused topic's rows go again")
    resumed.add_argument("topic", metavar="TOPIC", help="the topic (exact)")
    _replay_arguments(
        add(
            "replay",
            cmd_replay,
            "put rows kept as sent (RELAY_RETENTION_SECONDS) back into the outbox as new rows",
        )
    )
    return parser


def _replay_arguments(replay_cmd: argparse.ArgumentParser) -> None:
    replay_cmd.add_argument("--topic", required=True, help="the rows of this topic (exact)")
    replay_cmd.add_argument(
        "--since",
        type=parse_time,
        required=True,
        metavar="TIME",
        help="rows sent from this time: ISO 8601 (UTC without an offset) or how long ago"
        " (2h, 30m); not before the oldest row kept",
    )
    replay_cmd.add_argument(
        "--until",
        type=parse_time,
        metavar="TIME",
        help="... up to this time, not included (default: now), as --since takes it",
    )
    replay_cmd.add_argument("--key", help="only the rows of this key (exact)")
    replay_cmd.add_argument(
        "--max-rows",
        type=_positive_int,
        default=replay.MAX_ROWS,
        metavar="N",
        help=f"refuse (exit 2) a replay of more rows than this, rather than cut it short"
        f" (default {replay.MAX_ROWS})",
    )
    replay_cmd.add_argument(
        "--dry-run",
        action="store_true",
        help="change nothing: print how many rows it would put back",
    )


def _migrate_arguments(migrate_cmd: argparse.ArgumentParser) -> None:
    migrate_cmd.add_argument(
        "--shards",
        type=_positive_int,
        default=1,
        help="also build the indexes N shards fetch through (CONCURRENTLY; idempotent)",
    )
    migrate_cmd.add_argument(
        "--fairness-group",
        type=_fairness_group,
        metavar="SPEC",
        help="also build the index RELAY_FAIRNESS_GROUP=SPEC fetches through (with --shards"
        " N: for N shards; CONCURRENTLY; idempotent)",
    )
    migrate_cmd.add_argument(
        "--own-table",
        action="store_true",
        help="also prepare RELAY_OUTBOX_TABLE, an existing table, to be drained: the relay's"
        " bookkeeping columns and indexes, and a view by RELAY_OUTBOX_COLUMNS (idempotent)",
    )
    migrate_cmd.add_argument(
        "--dry-run",
        action="store_true",
        help="with --own-table: print its SQL for a DBA and apply nothing",
    )
    key_index = migrate_cmd.add_mutually_exclusive_group()
    key_index.add_argument(
        "--without-key-index",
        action="store_true",
        help="drop the key index the fair fetch reads, and every shard count's (--shards N"
        " then builds only the other), so the app's inserts pay only for the primary key;"
        " only once every relay runs with RELAY_FAIRNESS=off (CONCURRENTLY; idempotent)",
    )
    key_index.add_argument(
        "--with-key-index",
        action="store_true",
        help="build it again (with --shards N: that count's too), before any relay runs with"
        " RELAY_FAIRNESS=keys (CONCURRENTLY; idempotent)",
    )
    notify = migrate_cmd.add_mutually_exclusive_group()
    notify.add_argument(
        "--notify-trigger",
        type=_channel,
        metavar="CHANNEL",
        help="also create a trigger that NOTIFYs CHANNEL on every INSERT into the outbox"
        " (for plain-SQL apps; set RELAY_NOTIFY_CHANNEL to the same name)",
    )
    notify.add_argument(
        "--drop-notify-trigger", action="store_true", help="drop that trigger if present"
    )


def _status_arguments(status: argparse.ArgumentParser) -> None:
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--count-cap",
        type=_positive_int,
        default=1_000_000,
        metavar="N",
        help="stop counting rows at N (bounds the query on a huge outbox; default 1000000)",
    )


def _dead_letter_commands(dead: argparse.ArgumentParser) -> None:
    """`dead-letter` has actions of its own, each with its `func`, rather than options."""
    dead_sub = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    listing = dead_sub.add_parser("list", help="list dead-lettered rows, oldest first")
    listing.set_defaults(func=cmd_dead_letter_list)
    listing.add_argument("--topic", help="only the rows of this topic (exact)")
    listing.add_argument("--key", help="only the rows of this key (exact)")
    listing.add_argument(
        "--limit",
        type=_positive_int,
        default=100,
        help="list at most this many rows, oldest first (stderr says when more exist)",
    )
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    requeue = dead_sub.add_parser("requeue", help="put dead-lettered rows back in the drain")
    requeue.set_defaults(func=cmd_dead_letter_requeue)
    which = requeue.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=int, nargs="+", help="row ids")
    which.add_argument("--key", help="every dead letter of this key")
    which.add_argument("--all", action="store_true", help="every dead letter")
    requeue.add_argument(
        "--dry-run",
        action="store_true",
        help="requeue nothing: roll back and print what would be requeued",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except SettingsError as exc:
        print(f"relay: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except MigrationError as exc:
        print(f"relay: migration failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except psycopg.OperationalError as exc:
        print(f"relay: database unavailable: {db.describe_error(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except psycopg.errors.UndefinedTable as exc:
        print(
            f"relay: the schema is missing ({db.describe_error(exc)}): run `relay migrate`",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except psycopg.Error as exc:
        print(f"relay: database error: {db.describe_error(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
