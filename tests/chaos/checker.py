"""Properties of a recorded chaos history (docs/DESIGN.md, "What is tested, for real").

Pure functions over `History`: each check returns findings, empty when the property
holds. The numbered properties are the issue's:

1. every committed message delivered at least once; nothing else delivered
   (no rolled-back, never-committed or poison message);
2. per key, after dedup by message-id, messages arrive in sequence order;
3. at most one replica held any epoch, and no batch was settled under an epoch that a
   newer acquisition had already superseded (by the database's clock);
4. duplicates stay within what the faults could have put in flight;
5. every poison row is dead-lettered with a reason, and no good row is;
6. after the last fault, lag returns to 0 within a bound.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise

from tests.chaos.history import Acquired, Delivered, History, Settled

SHOW = 5  # examples quoted per finding


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    detail: str


@dataclass(slots=True)
class Report:
    findings: list[Finding] = field(default_factory=list)
    committed: int = 0
    delivered: int = 0
    unique: int = 0
    duplicates: int = 0
    duplicate_bound: int = 0
    epochs: int = 0
    settles: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

    def checks_failed(self) -> set[str]:
        return {f.check for f in self.findings}

    def summary(self) -> str:
        lines = [
            f"committed={self.committed} delivered={self.delivered} unique={self.unique}"
            f" duplicates={self.duplicates} (bound {self.duplicate_bound})"
            f" epochs={self.epochs} settles={self.settles}"
        ]
        lines += [f"FAIL {f.check}: {f.detail}" for f in self.findings]
        return "\n".join(lines)


def _examples(items: Sequence[object]) -> str:
    more = f" (+{len(items) - SHOW} more)" if len(items) > SHOW else ""
    return ", ".join(str(i) for i in items[:SHOW]) + more


def check_delivery(history: History) -> list[Finding]:
    """(1) at least once for committed messages, never for anything else."""
    findings = []
    expected = {p.message_id: p for p in history.committed if p.kind == "normal"}
    delivered = {d.message_id for d in history.delivered}
    lost = sorted(
        (p for mid, p in expected.items() if mid not in delivered), key=lambda p: (p.key, p.seq)
    )
    if lost:
        findings.append(
            Finding(
                "lost",
                f"{len(lost)} committed message(s) never delivered: "
                + _examples([f"{p.key}:{p.seq}" for p in lost]),
            )
        )
    poison = {p.message_id for p in history.committed if p.kind == "poison"}
    phantom = sorted(mid for mid in delivered if mid not in expected)
    if phantom:
        kinds = Counter(
            "poison"
            if mid in poison
            else ("rolled back" if mid in history.attempted_ids else "unknown")
            for mid in phantom
        )
        findings.append(
            Finding(
                "phantom",
                f"{len(phantom)} delivered message(s) that were not committed good rows"
                f" ({dict(kinds)}): {_examples(phantom)}",
            )
        )
    return findings


def first_deliveries_by_key(delivered: Sequence[Delivered]) -> dict[str | None, list[Delivered]]:
    """Each key's records in broker order (incarnation, then offset), first copy only."""
    by_key: dict[str | None, list[Delivered]] = defaultdict(list)
    seen: set[str] = set()
    for record in sorted(delivered, key=lambda d: (d.generation, d.partition, d.offset)):
        if record.message_id in seen:
            continue
        seen.add(record.message_id)
        by_key[record.key].append(record)
    return by_key


def check_order(history: History) -> list[Finding]:
    """(2) per key, after dedup by message-id, sequence numbers only go up."""
    broken = []
    for key, records in first_deliveries_by_key(history.delivered).items():
        seqs = [r.seq for r in records if r.seq is not None]
        for before, after in pairwise(seqs):
            if after <= before:
                broken.append(f"{key}: {before} then {after}")
                break
    if broken:
        return [Finding("order", f"{len(broken)} key(s) out of order: {_examples(broken)}")]
    return []


def check_epochs(history: History) -> list[Finding]:
    """(3) one holder per epoch; every settle's epoch was still the newest at its time.
    Epochs belong to a lease row: with shards, each shard's lease is checked alone."""
    findings: list[Finding] = []
    for lease in sorted(
        {a.lease for a in history.acquisitions} | {s.lease for s in history.settles}
    ):
        findings += _check_lease_epochs(
            lease,
            [a for a in history.acquisitions if a.lease == lease],
            [s for s in history.settles if s.lease == lease],
        )
    return findings


def _check_lease_epochs(
    lease: str, acquisitions: Sequence[Acquired], settles: Sequence[Settled]
) -> list[Finding]:
    findings = []
    where = "" if lease == "default" else f"{lease} "
    holders: dict[int, set[str]] = defaultdict(set)
    first_at: dict[int, datetime] = {}
    for a in acquisitions:
        holders[a.epoch].add(a.holder)
        first_at[a.epoch] = min(a.db_time, first_at.get(a.epoch, a.db_time))
    shared = [f"{where}epoch {e}: {sorted(h)}" for e, h in sorted(holders.items()) if len(h) > 1]
    if shared:
        findings.append(Finding("epoch_shared", _examples(shared)))

    # The earliest moment any newer epoch existed, for each epoch.
    superseded_at: dict[int, datetime | None] = {}
    newer: datetime | None = None
    for epoch in sorted(first_at, reverse=True):
        superseded_at[epoch] = newer
        newer = first_at[epoch] if newer is None else min(newer, first_at[epoch])
    stale, foreign = [], []
    for s in settles:
        owners = holders.get(s.epoch)
        if owners and s.holder not in owners:
            foreign.append(f"{s.holder} settled under {where}epoch {s.epoch} of {sorted(owners)}")
        # A settle under an epoch nobody logged acquiring: superseded once any newer
        # epoch exists.
        limit = superseded_at.get(s.epoch) or min(
            (t for e, t in first_at.items() if e > s.epoch), default=None
        )
        if limit is not None and s.db_time >= limit:
            stale.append(
                f"{s.holder} {where}epoch {s.epoch} settled ids {s.first_id}..{s.last_id}"
                f" at {s.db_time.isoformat()}, after epoch >{s.epoch} began at"
                f" {limit.isoformat()}"
            )
    if foreign:
        findings.append(Finding("settle_by_non_holder", _examples(foreign)))
    if stale:
        findings.append(Finding("stale_mark", f"{len(stale)} batch(es): {_examples(stale)}"))
    return findings


def duplicate_count(delivered: Sequence[Delivered]) -> int:
    return len(delivered) - len({d.message_id for d in delivered})


def duplicate_bound(history: History) -> int:
    return sum(f.in_flight_bound for f in history.faults)


def check_duplicates(history: History) -> list[Finding]:
    """(4) duplicates only from batches in flight at a fault."""
    count, bound = duplicate_count(history.delivered), duplicate_bound(history)
    if count > bound:
        return [Finding("duplicates", f"{count} duplicates > {bound} in flight at the faults")]
    return []


def check_dead_letters(history: History) -> list[Finding]:
    """(5) poison rows dead-lettered with a reason; good rows never."""
    findings = []
    poison = [p for p in history.committed if p.kind == "poison"]
    missing = [f"{p.key}:{p.seq}" for p in poison if not history.dead_letters.get(p.message_id)]
    if missing:
        findings.append(
            Finding(
                "poison_not_dead_lettered",
                f"{len(missing)} poison row(s) without a dead-letter reason: {_examples(missing)}",
            )
        )
    good = {p.message_id: p for p in history.committed if p.kind == "normal"}
    wrongly = [
        f"{good[mid].key}:{good[mid].seq} ({reason})"
        for mid, reason in history.dead_letters.items()
        if mid in good
    ]
    if wrongly:
        findings.append(Finding("good_row_dead_lettered", _examples(wrongly)))
    return findings


def check_recovery(history: History) -> list[Finding]:
    """(6) lag back to 0 within the bound after the last fault."""
    if history.recovery_seconds is None or history.recovery_seconds > history.recovery_bound:
        took = "never" if history.recovery_seconds is None else f"{history.recovery_seconds:.1f}s"
        return [
            Finding("lag", f"lag did not return to 0 within {history.recovery_bound:.0f}s ({took})")
        ]
    return []


CHECKS: tuple[Callable[[History], list[Finding]], ...] = (
    check_delivery,
    check_order,
    check_epochs,
    check_duplicates,
    check_dead_letters,
    check_recovery,
)


def check(history: History) -> Report:
    report = Report(
        committed=sum(p.kind == "normal" for p in history.committed),
        delivered=len(history.delivered),
        unique=len({d.message_id for d in history.delivered}),
        duplicates=duplicate_count(history.delivered),
        duplicate_bound=duplicate_bound(history),
        epochs=len({(a.lease, a.epoch) for a in history.acquisitions}),
        settles=len(history.settles),
    )
    for run in CHECKS:
        report.findings += run(history)
    return report
