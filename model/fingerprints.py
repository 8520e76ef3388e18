"""The model's steps name the statements of relay/sql/ they stand for, each with a
fingerprint of its text; these compute the fingerprints so a test can tell when a
statement changed and the model was not looked at again."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from relay.sql import QUERIES

MODEL = Path(__file__).with_name("lease.pml")

# `sql: <file> <statement> sha256:<16 hex digits>` in a comment of lease.pml.
_RECORD = re.compile(r"sql: (?P<file>[a-z_]+\.sql) (?P<name>[a-z_]+) sha256:(?P<digest>[0-9a-f]+)")
# A string literal, a quoted name or a line comment: comments go, quoted text stays.
_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*")


@dataclass(frozen=True, slots=True)
class Record:
    file: str
    name: str
    digest: str


def normalise(sql: str) -> str:
    """The statement without its comments and with all whitespace one space: a change
    of wording in a comment or of layout is no change of what the database runs."""
    text = _TOKEN.sub(lambda match: "" if match.group().startswith("--") else match.group(), sql)
    return " ".join(text.split())


def fingerprint(name: str) -> str:
    """The first 16 hex digits of the SHA-256 of the statement as relay/sql/__init__.py loads
    it (fragments filled in), normalised."""
    sql = normalise(QUERIES.get(name).sql)
    return hashlib.sha256(sql.encode()).hexdigest()[:16]


def source(name: str) -> str:
    """The file a statement is written in."""
    return QUERIES.get(name).source


def recorded(text: str | None = None) -> list[Record]:
    """Every statement the model names, as recorded in it, in order of appearance."""
    text = MODEL.read_text("utf-8") if text is None else text
    return [Record(m["file"], m["name"], m["digest"]) for m in _RECORD.finditer(text)]


def refresh(text: str) -> str:
    """`text` with every recorded fingerprint replaced by the current one."""
    return _RECORD.sub(
        lambda m: f"sql: {m['file']} {m['name']} sha256:{fingerprint(m['name'])}", text
    )
