"""Loads `sql/queries.sql` into named statements.

Keeping every statement in one file lets a DBA review the relay's whole footprint on
their database in one read; Python refers to a statement only by its name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import LiteralString

_HEADER = re.compile(r"^-- name: (?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    description: str
    sql: LiteralString  # shipped with the package, never built from input


def parse(text: str) -> dict[str, Query]:
    """Split the file at `-- name:` headers; comment lines right after are the description."""
    found: dict[str, Query] = {}
    headers = list(_HEADER.finditer(text))
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body = text[header.end() : end].strip("\n")
        description: list[str] = []
        statement: list[str] = []
        for line in body.splitlines():
            if not statement and line.startswith("--"):
                description.append(line.removeprefix("--").strip())
            elif line.startswith("-----"):
                break  # a section ruler starts the next group
            else:
                statement.append(line)
        sql = "\n".join(statement).strip()
        name = header.group("name")
        if not sql:
            raise ValueError(f"query {name!r} has no SQL")
        if name in found:
            raise ValueError(f"query {name!r} is defined twice")
        # The file ships with the package and is not user input: it is as literal as a
        # string in the source, which is what psycopg's LiteralString typing asks for.
        found[name] = Query(name, " ".join(description), sql)
    return found


class _Queries:
    def __init__(self, queries: dict[str, Query]) -> None:
        self._queries = queries

    def __getattr__(self, name: str) -> LiteralString:
        try:
            return self._queries[name].sql
        except KeyError:
            raise AttributeError(f"no query named {name!r} in queries.sql") from None

    def names(self) -> list[str]:
        return sorted(self._queries)

    def get(self, name: str) -> Query:
        return self._queries[name]


QUERIES = _Queries(parse(resources.files("relay").joinpath("sql/queries.sql").read_text("utf-8")))
