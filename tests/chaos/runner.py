"""One chaos run: servers up, three replicas, producer and recorder running, a seeded
schedule of faults, then recovery, a clean stop, and the checker over the history.
The sink is Kafka unless named (tests/chaos/sinks.py: kafka, nats, rabbitmq)."""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tests.chaos.checker import Finding, Report, check
from tests.chaos.cluster import Cluster, libfaketime, make_workdir
from tests.chaos.faults import LEADER_FAULTS, Injector, Timing, schedule
from tests.chaos.history import History, Produced, read_lease_history
from tests.chaos.producer import Producer
from tests.chaos.sinks import ChaosSink, Recorder, make_sink


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    messages: int
    faults: int
    rate: float  # messages/s offered by the producer
    keys: int = 40
    batch: int = 50
    ttl: float = 3.0
    gap: tuple[float, float] = (1.5, 3.5)  # seconds between a healed fault and the next
    late_hold: tuple[float, float] = (0.5, 3.0)
    recovery_bound: float = 60.0
    shards: int = 1  # RELAY_SHARDS: >1, every replica drains its fair share at once


PROFILES = {
    "short": Profile("short", messages=3_000, faults=10, rate=45.0),
    "medium": Profile("medium", messages=20_000, faults=25, rate=150.0),
    "long": Profile("long", messages=100_000, faults=50, rate=300.0, batch=200),
    "sharded": Profile("sharded", messages=3_000, faults=10, rate=45.0, shards=8),
}
REPLICAS = 3


@dataclass(slots=True)
class Outcome:
    seed: int
    profile: Profile
    sink: str
    report: Report
    history: History
    produced: int
    seconds: float
    workdir: Path
    notes: list[str] = field(default_factory=list)

    @property
    def max_takeover(self) -> float | None:
        takeovers = [f.takeover_seconds for f in self.history.faults if f.takeover_seconds]
        return max(takeovers) if takeovers else None

    def summary(self) -> str:
        faults = ", ".join(f"{f.kind}@{f.at:.0f}s" for f in self.history.faults)
        takeover = f"{self.max_takeover:.2f}s" if self.max_takeover else "n/a"
        recovery = self.history.recovery_seconds
        lines = [
            f"chaos profile={self.profile.name} sink={self.sink} seed={self.seed}"
            f" run={self.seconds:.0f}s messages={self.produced}"
            f" faults={len(self.history.faults)} max_takeover={takeover}"
            f" recovery={'never' if recovery is None else f'{recovery:.1f}s'}",
            f"faults: {faults}",
            *self.notes,
            self.report.summary(),
            f"logs: {self.workdir}",
        ]
        return "\n".join(lines)


def say(text: str) -> None:
    print(f"[chaos] {text}", file=sys.stderr, flush=True)


def run(
    profile: Profile, seed: int, sink_name: str = "kafka", workdir: Path | None = None
) -> Outcome:
    say(
        f"profile={profile.name} sink={sink_name} seed={seed}"
        f" (replay: python -m tests.chaos --sink {sink_name} --seed {seed})"
    )
    rng = random.Random(seed)
    workdir = workdir or make_workdir()
    give_way = 3.0
    sink = make_sink(sink_name, delivery_timeout=5.0)
    cluster = Cluster(
        workdir,
        sink,
        replicas=REPLICAS,
        shards=profile.shards,
        settings={
            "RELAY_LEASE_TTL_SECONDS": str(profile.ttl),
            "RELAY_BATCH_SIZE": str(profile.batch),
            "RELAY_RETRY_BASE_SECONDS": "0.1",
            "RELAY_RETRY_MAX_SECONDS": "1",
            # A leader that cannot reach the sink hands over (cut_leader_from_broker);
            # the window must cover two heartbeats.
            "RELAY_GIVE_WAY_SECONDS": str(give_way),
        },
    )
    notes = []
    # Off by default: under libfaketime, Python's own timed waits (Condition.wait,
    # Event.wait) sleep for about the skew, so the skewed replica never drains or renews
    # — an artifact of the preload, not a test of the relay (README, Reliability).
    skew = os.environ.get("RELAY_CHAOS_SKEW")
    if skew and libfaketime() is not None:
        cluster.replicas[-1].skew = skew
        notes.append(f"clock skew: {cluster.replicas[-1].name} runs with wall clock {skew}")
    else:
        notes.append("clock skew: off (set RELAY_CHAOS_SKEW=+600s with faketime installed)")
    notes.append("db network latency (tc/netem): not injected (loopback is shared; see README)")
    if not cluster.netcut:
        notes.append("broker cut (cut_leader_from_broker): off, Kafka needs root and unshare")
    started = time.monotonic()
    history = History(recovery_bound=profile.recovery_bound)
    producer: Producer | None = None
    recorder: Recorder | None = None
    try:
        cluster.start_servers()
        cluster.start_replicas()
        recorder = sink.recorder
        recorder.start()
        producer = Producer(
            cluster.admin_dsn,
            cluster.topic,
            seed=seed,
            keys=profile.keys,
            target=profile.messages,
            rate=profile.rate,
            late_hold=profile.late_hold,
        )
        # With shards, a faulted replica can hold the share of all but one replica.
        per_replica = -(-profile.shards // (REPLICAS - 1)) if profile.shards > 1 else 1
        timing = Timing(
            profile.ttl, profile.batch, sink.publish_timeout, started, give_way, per_replica
        )
        injector = Injector(cluster, timing, rng)
        injector.leader(timeout=60)
        producer.start()
        for n, kind in enumerate(schedule(rng, profile.faults, netcut=cluster.netcut), 1):
            time.sleep(rng.uniform(*profile.gap))  # the schedule's pause between faults
            cluster.note_unexpected_exits()
            fault = injector.run(kind)
            history.faults.append(fault)
            say(
                f"fault {n}/{profile.faults}: {fault.kind} at {fault.at:.1f}s {fault.note}"
                + (f" takeover {fault.takeover_seconds:.2f}s" if fault.takeover_seconds else "")
            )
            cluster.note_unexpected_exits()
            injector.heal()
        # Faults over: let the producer reach its target, then stop it.
        while not producer.done:
            time.sleep(0.2)
        producer.stop()
        producer.join(timeout=30)
        history.recovery_seconds = _recover(cluster, recorder, profile.recovery_bound)
        cluster.note_unexpected_exits()
        metrics = [cluster.scrape(r) for r in cluster.replicas if r.alive()]
        recorder.stop()
        cluster.stop_replicas()
        _collect(cluster, recorder, producer, history)
        report = check(history)
        report.findings += _secret_findings(cluster, metrics)
        report.findings += _exactness_findings(sink, report)
        report.findings += [
            Finding("replica_crashed", exit)
            for r in cluster.replicas
            for exit in r.unexpected_exits
        ]
        leader_faults = [f for f in history.faults if f.kind in LEADER_FAULTS]
        notes.append(
            f"producer: {producer.stats.transactions} transactions,"
            f" {producer.stats.rolled_back_tx} rolled back, {producer.stats.late_tx} late,"
            f" {producer.stats.poison} poison, {producer.stats.errors} failed on a fault;"
            f" {len(leader_faults)} leader faults"
        )
        return Outcome(
            seed,
            profile,
            sink.name,
            report,
            history,
            producer.produced,
            time.monotonic() - started,
            workdir,
            notes,
        )
    finally:
        if producer is not None:
            producer.stop()
        if recorder is not None:
            recorder.stop()
        cluster.stop()


def _recover(cluster: Cluster, recorder: Recorder, bound: float) -> float | None:
    """Seconds until nothing is unsent and every committed message was consumed."""
    started = time.monotonic()
    deadline = started + bound * 2  # measured past the bound too, so the report says how far
    while time.monotonic() < deadline:
        if cluster.unsent() == 0 and _committed_ids(cluster) <= recorder.ids():
            return round(time.monotonic() - started, 2)
        time.sleep(0.2)
    return None


def _committed_ids(cluster: Cluster) -> set[str]:
    with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id::text FROM chaos_ledger WHERE kind = 'normal'")
        return {r[0] for r in rows}


def _collect(cluster: Cluster, recorder: Recorder, producer: Producer, history: History) -> None:
    with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
        history.committed = [
            Produced(r[0], r[1], int(r[2]), r[3])
            for r in conn.execute("SELECT message_id::text, key, seq, kind FROM chaos_ledger")
        ]
        history.dead_letters = {
            r[0]: r[1]
            for r in conn.execute(
                "SELECT message_id::text, dead_letter_reason FROM outbox_dead_letters"
            )
        }
    history.attempted_ids = set(producer.stats.attempted)
    history.delivered = recorder.records
    history.acquisitions, history.settles = read_lease_history(r.log_path for r in cluster.replicas)


def _secret_findings(cluster: Cluster, metrics: list[str]) -> list[Finding]:
    findings = []
    for replica in cluster.replicas:
        text = replica.log_path.read_text(errors="replace")
        if cluster.password in text:
            findings.append(Finding("secret_leak", f"database password in {replica.log_path}"))
    if any(cluster.password in body for body in metrics):
        findings.append(Finding("secret_leak", "database password in /metrics"))
    if not metrics:
        findings.append(Finding("secret_leak", "no /metrics scraped: nothing was checked"))
    return findings


def _exactness_findings(sink: ChaosSink, report: Report) -> list[Finding]:
    """A sink whose server drops redeliveries (JetStream's duplicate window) holds each
    message once, whatever the faults put in flight."""
    if sink.exact and report.duplicates:
        return [
            Finding(
                "duplicates",
                f"{report.duplicates} duplicate(s) stored by {sink.name}, which should drop"
                " every redelivery of a message id",
            )
        ]
    return []


def cleanup(outcome: Outcome) -> None:
    shutil.rmtree(outcome.workdir, ignore_errors=True)
