"""Loads the SQL files in `relay/sql/` into named statements.

Every statement the relay runs is in those files, one file per caller (the drain, the
lease, operations, migrations, ...), so a DBA reviews the relay's whole footprint on
their database there; Python refers to a statement only by its name, never its file.

A rule several statements of a file share is written once, as a fragment:

    -- fragment: this_shard
    (%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, ...) = %(shard)s::integer)

and `{{this_shard}}` in a statement of that file becomes this text at load time, lined up
under the marker: the database receives plain SQL and plans it as if the rule were
written out there. The marker is no SQL and no psycopg `%(x)s` parameter, and it is
filled in before any statement reaches `psycopg.sql.SQL(...).format`, whose `{x}`
placeholders it leaves alone (there `{{x}}` would be a literal `{x}`, which no statement
needs: a marker naming no fragment is a load error, so one is never taken for the other
silently). A fragment no statement uses is an error too. A fragment may use other
fragments (never itself, however indirectly), so a long statement can be written as a
short outline of parts a page each; fragments belong to their file, so a statement's
rules are in the file its reader has open.
"""

from __future__ import annotations

import functools
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import LiteralString

_HEADER = re.compile(r"^-- (?P<kind>name|fragment): (?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_MARKER = re.compile(r"\{\{(?P<name>[a-z_][a-z0-9_]*)\}\}")


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    source: str  # the file it is written in, for errors and for readers
    description: str
    sql: LiteralString  # shipped with the package, never built from input


def _blocks(text: str) -> Iterator[tuple[str, str, str, str]]:
    """(kind, name, description, text) per header; comment lines right after a header
    are its description, and a section ruler ends the block."""
    headers = list(_HEADER.finditer(text))
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        description: list[str] = []
        body: list[str] = []
        for line in text[header.end() : end].strip("\n").splitlines():
            if not body and line.startswith("--"):
                description.append(line.removeprefix("--").strip())
            elif line.startswith("-----"):
                break  # a section ruler starts the next group
            else:
                body.append(line)
        kind, name = header.group("kind", "name")
        yield kind, name, " ".join(description), "\n".join(body).strip()


def parse(text: str, source: str = "<text>") -> dict[str, Query]:
    """One file's statements, with its fragments filled in."""
    statements: list[tuple[str, str, str]] = []
    fragments: dict[str, str] = {}
    for kind, name, description, body in _blocks(text):
        if not body:
            raise ValueError(f"{source}: {kind} {name!r} has no SQL")
        if kind == "fragment":
            if name in fragments:
                raise ValueError(f"{source}: fragment {name!r} is defined twice")
            if "--" in body.splitlines()[-1]:
                # Pasted before more text on the marker's line, it would comment that out.
                raise ValueError(f"{source}: fragment {name!r} ends in a comment")
            fragments[name] = textwrap.dedent(body)
        else:
            statements.append((name, description, body))

    used: set[str] = set()

    def fill(user: str, within: tuple[str, ...], match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in fragments:
            raise ValueError(f"{source}: {user} uses {{{{{name}}}}}: no such fragment")
        if name in within:
            chain = " -> ".join((*within[within.index(name) :], name))
            raise ValueError(f"{source}: fragment {name!r} uses itself ({chain})")
        used.add(name)
        text = _MARKER.sub(
            functools.partial(fill, f"fragment {name!r}", (*within, name)), fragments[name]
        )
        # Later lines line up under the marker, so the SQL the server logs stays readable.
        indent = " " * (match.start() - match.string.rfind("\n", 0, match.start()) - 1)
        first, *rest = text.splitlines()
        return "\n".join([first, *(indent + line if line else line for line in rest)])

    found: dict[str, Query] = {}
    for name, description, body in statements:
        if name in found:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        sql = _MARKER.sub(functools.partial(fill, f"query {name!r}", ()), body)
        # The file ships with the package and is not user input: it is as literal as a
        # string in the source, which is what psycopg's LiteralString typing asks for.
        found[name] = Query(name, source, description, sql)
    if unused := sorted(fragments.keys() - used):
        raise ValueError(f"{source}: fragments no query uses: {', '.join(unused)}")
    return found


def load(files: Iterable[Traversable]) -> dict[str, Query]:
    """Every file's statements; a name is unique across files, whatever file holds it."""
    found: dict[str, Query] = {}
    for file in sorted(files, key=lambda file: file.name):
        for name, query in parse(file.read_text("utf-8"), file.name).items():
            if name in found:
                raise ValueError(
                    f"query {name!r} is defined in both {found[name].source} and {file.name}"
                )
            found[name] = query
    return found


class _Queries:
    def __init__(self, queries: dict[str, Query]) -> None:
        self._queries = queries

    def __getattr__(self, name: str) -> LiteralString:
        try:
            return self._queries[name].sql
        except KeyError:
            raise AttributeError(f"no query named {name!r} in relay/sql/*.sql") from None

    def names(self) -> list[str]:
        return sorted(self._queries)

    def get(self, name: str) -> Query:
        return self._queries[name]


QUERIES = _Queries(
    load(
        file
        for file in resources.files("relay").joinpath("sql").iterdir()
        if file.name.endswith(".sql")
    )
)
