"""`relay sql`: every statement the relay runs, printed so a DBA can paste it into psql."""

from __future__ import annotations

import re
import subprocess

import pytest

from relay.admin import statements
from relay.admin.cli import main
from relay.sql import QUERIES
from tests.conftest import relay_command
from tests.support import insert_rows


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        relay_command("sql", *args), capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.unit
def test_every_statement_prints_with_psql_variables_and_nothing_of_psycopg_left() -> None:
    for row in statements.every():
        sql = row.text
        assert "%(" not in sql, row.name
        assert "{{" not in sql, row.name  # fragments filled in
        for parameter in row.parameters:
            assert f":'{parameter}'" in sql, (row.name, parameter)
        # Back to what psycopg receives: the same text.
        back = re.sub(r":'([a-z_][a-z0-9_]*)'", r"%(\1)s", sql)
        back = re.sub(r':"([a-z_][a-z0-9_]*)"', r"{\1}", back)
        assert back == QUERIES.get(row.name).sql.replace("%%", "%"), row.name


@pytest.mark.unit
def test_the_list_names_every_statement_and_one_prints_with_what_to_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sql", "--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == QUERIES.names()
    assert main(["sql", "fetch_head"]) == 0
    shown = capsys.readouterr().out
    assert "--   \\set limit ''" in shown
    assert "--   \\set in_flight ''  (bigint[])" in shown
    assert main(["sql", "no_such_statement"]) == 2
    assert "relay sql --list" in capsys.readouterr().err


def test_relay_sql_runs_as_a_command_without_a_database() -> None:
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    assert "fetch_head" in listed.stdout


def test_a_printed_fetch_runs_in_psql_and_returns_the_rows_in_order(database: str) -> None:
    ids = insert_rows(database, "orders", [("k1", b"a"), ("k2", b"b"), ("k1", b"c")])
    printed = run("fetch_head")
    assert printed.returncode == 0, printed.stderr
    values = {
        "message_max": "1048576",
        "max_bytes": "1048576",
        "held": "{}",
        "in_flight": "{}",
        "in_flight_ranges": "{}",
        "shards": "1",
        "shard": "0",
        "after": "0",
        "limit": "10",
    }
    settings = "".join(f"\\set {name} '{value}'\n" for name, value in values.items())
    done = subprocess.run(
        ["psql", database, "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1"],
        input=settings + "SELECT 'rows:';\n" + printed.stdout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    fetched = done.stdout.split("rows:", 1)[1].split()
    assert [int(line.split("|")[0]) for line in fetched] == ids
