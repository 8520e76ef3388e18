"""`relay sql`: every statement the relay runs, printed for a DBA to read and run.

A statement is printed as the relay sends it, its fragments filled in, with its
parameters as psql variables: `%(shard)s` becomes `:'shard'` (a quoted literal the
statement's own casts turn into its type) and a `{index}` placeholder, which
psycopg's sql module fills with an identifier, becomes `:"index"`. A header lists the `\\set` lines
to give them values, so the text can be pasted into psql as it is.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from relay.sql import QUERIES, Query

_PARAMETER = re.compile(r"%\((?P<name>[a-z_][a-z0-9_]*)\)s")
_CAST = re.compile(r"%\((?P<name>[a-z_][a-z0-9_]*)\)s::(?P<type>[a-z_][a-z0-9_ ]*(?:\[\])?)")
_IDENTIFIER = re.compile(r"(?<!\{)\{(?P<name>[a-z_][a-z0-9_]*)\}(?!\})")


@dataclass(frozen=True, slots=True)
class Printed:
    name: str
    source: str
    description: str
    parameters: tuple[str, ...]  # in the order they first appear
    types: dict[str, str]  # a parameter's cast in the statement, where it has one
    identifiers: tuple[str, ...]
    text: str  # for psql: the parameters as variables

    @property
    def lines(self) -> int:
        """Lines of SQL, comments and blank lines aside: what a reader has to read."""
        return sum(1 for line in self.text.splitlines() if _is_sql(line))


def _is_sql(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("--")


def _first(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def printed(query: Query) -> Printed:
    parameters = _first(_PARAMETER.findall(query.sql))
    identifiers = _first(_IDENTIFIER.findall(query.sql))
    text = _PARAMETER.sub(lambda m: f":'{m['name']}'", query.sql)
    text = _IDENTIFIER.sub(lambda m: f':"{m["name"]}"', text)
    text = text.replace("%%", "%")
    types = {m["name"]: m["type"].strip() for m in _CAST.finditer(query.sql)}
    return Printed(
        query.name, query.source, query.description, parameters, types, identifiers, text
    )


def every() -> list[Printed]:
    return [printed(QUERIES.get(name)) for name in QUERIES.names()]


def listing() -> str:
    """One line a statement: its name, its file, its length, what it is for."""
    rows = every()
    width = max(len(row.name) for row in rows)
    lines = []
    for row in rows:
        about = textwrap.shorten(row.description.split(". ")[0], width=90, placeholder=" ...")
        lines.append(f"{row.name:<{width}}  {row.source:<16} {row.lines:>4} lines  {about}")
    return "\n".join(lines)


def for_psql(name: str) -> str:
    """The statement as psql takes it, with a header saying what to set first."""
    row = printed(QUERIES.get(name))
    about = f"{row.name} ({row.source}): {row.description}".rstrip(": ")
    header = textwrap.wrap(about, width=88, initial_indent="-- ", subsequent_indent="-- ")
    if row.parameters or row.identifiers:
        header.append("-- Set its parameters first, in psql:")
        header += [
            f"--   \\set {parameter} ''"
            + (f"  ({row.types[parameter]})" if parameter in row.types else "")
            for parameter in row.parameters
        ]
        header += [f"--   \\set {identifier} name" for identifier in row.identifiers]
    return "\n".join([*header, row.text.rstrip().rstrip(";") + ";"])
