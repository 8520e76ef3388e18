"""The lease protocol's Spin model (model/): it is checked, its mutants are caught, and
it cannot drift from the SQL it stands for unnoticed."""

from __future__ import annotations

import re
import shutil

import pytest

from model import checker, fingerprints
from relay.sql import QUERIES
from tests import model_runs


def _require_spin() -> None:
    """The test command installs spin and gcc (./dev ensure_spin): missing is a failure."""
    for tool in ("spin", "gcc"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: run ./dev test (or ./dev model), which installs it")


@pytest.mark.unit
def test_every_step_names_statements_whose_text_it_recorded() -> None:
    """A statement of relay/sql/ the model stands for changed: look at the model's step
    again, then record the new fingerprint (`python -m model --fingerprints`)."""
    records = fingerprints.recorded()
    assert records, "model/lease.pml names no statement"
    stale = []
    for record in records:
        assert record.name in QUERIES.names(), f"{record.name}: no such statement"
        assert fingerprints.source(record.name) == record.file, (
            f"{record.name} is in {fingerprints.source(record.name)}, not {record.file}"
        )
        current = fingerprints.fingerprint(record.name)
        if current != record.digest:
            stale.append(f"{record.file} {record.name}: model {record.digest}, now {current}")
    assert not stale, "statements changed since the model was checked against them:\n" + (
        "\n".join(stale)
    )


@pytest.mark.unit
def test_the_protocol_statements_are_all_named() -> None:
    named = {record.name for record in fingerprints.recorded()}
    protocol = {
        "lease_group_claim",
        "lease_read",
        "lease_take",
        "lease_renew",
        "lease_release",
        "settle_delete_sent",
        "settle_move_sent",
        "settle_mark_sent",
        "delete_sent",
        "move_sent",
        "mark_sent",
        "record_failures",
        "dead_letter",
    }
    assert protocol <= named, f"not in the model: {sorted(protocol - named)}"


@pytest.mark.unit
def test_a_changed_statement_changes_its_fingerprint_and_a_comment_does_not() -> None:
    sql = QUERIES.lease_take
    assert fingerprints.normalise(sql) == fingerprints.normalise(
        "-- a new comment\n" + sql.replace("\n", "\n\n  ")
    )
    assert fingerprints.normalise(sql) != fingerprints.normalise(
        sql.replace("AND epoch = %(seen_epoch)s", "")
    )
    assert fingerprints.normalise("SELECT '--x' -- y") == "SELECT '--x'"


def test_the_model_checks() -> None:
    _require_spin()
    done = model_runs.result("test_the_model_checks")
    assert done.returncode == 0, done.stdout + done.stderr
    for check in checker.CHECKS:
        assert f"{check.name}:" in done.stdout
    assert len(re.findall(r"states stored [\d,]+", done.stdout)) == len(checker.CHECKS)
    assert len(re.findall(r"errors 0", done.stdout)) == len(checker.CHECKS)
    assert "model: no violation" in done.stdout


def test_every_mutant_is_caught_with_a_trail() -> None:
    _require_spin()
    done = model_runs.result("test_every_mutant_is_caught_with_a_trail")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("mutant ")]
    assert len(lines) == len(checker.MUTANTS), done.stdout
    for mutant, line in zip(checker.MUTANTS, lines, strict=True):
        assert line.startswith(f"mutant {mutant.name} "), line
        assert f"caught: {mutant.expect} violated, trail of" in line, line
