"""No drift: what the code, the tests and the docs cite exists.

A comment that sends a reader to a README section that moved, a module that was
renamed or a file that was removed is worse than none. Four kinds of citation are
checked, in every tracked text file:

- a section: `README "Heading"`, `README, *Heading*`, `docs/DESIGN.md, "Heading"`,
  `the README's "Heading"`: the file has that heading;
- an anchor: `page.md#anchor` and `](#anchor)`: the page has a heading with that anchor;
- a file: `relay/...`, `tests/...`, `docs/...` and the other top folders: it exists;
  and a shorter path in backticks, `` `sinks/kafka/sink.py` ``: some file ends so;
- a module: `relay.x.y` (and `relay.x.y.name`): it imports, and has the name;
- a migration: `migration 0015`, `migrations 0018-0022`: migrations/ has that file (the
  ones a schema file replaced are gone: say what the thing is instead).

Left out: this file (its examples point nowhere on purpose), `migrations/*.sql`
(applied by checksum: a changed comment would stop every database that applied it),
and the changelogs, which name what was.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

TEXT_SUFFIXES = {".py", ".md", ".sql", ".toml", ".yaml", ".yml", ".pml", ".html", ".cfg", ".txt"}
TEXT_NAMES = {"Dockerfile", "dev", "run"}
LEFT_OUT = ("migrations/", "CHANGELOG.md", "docs/changelog.md", "tests/test_drift.py")

SECTION = re.compile(
    r"(?P<doc>\bREADME(?:\.md)?|\bCONTRIBUTING(?:\.md)?|\b(?:docs|deploy|model|bench)/[\w/.-]+\.md)"
    r"(?!\")(?!'(?!s))(?:'s)?,?\s*\(?(?:section\s+)?(?P<q>[\"*])(?P<section>[^\"*\n]{2,80})(?P=q)"
)
ANCHOR = re.compile(r"(?P<doc>[\w/.-]*\.md)?#(?P<anchor>[a-z0-9][a-z0-9-]*)\)")
FILE = re.compile(
    r"(?<![\w/.-])(?P<path>(?:relay|tests|docs|bench|demo|model|deploy|migrations|\.ci)"
    r"/(?:[\w.-]+/)*(?:[\w-]+\.[a-z]+|[\w.-]+/))(?![\w\\])"
)
# Paths that exist elsewhere than in a checkout: migrations/ inside the wheel.
ELSEWHERE = ("relay/migrations",)
PARTIAL = re.compile(r"`(?P<path>[\w/]+\.(?:py|sql))`")
MODULE = re.compile(r"(?<![\w./-])(?P<name>relay(?:\.[A-Za-z_]\w*)+)(?![\w(/-])")
# What is named like a module and is none: log events (`relay.started`), a log file.
LOG_EVENT = re.compile(r"\.(?:debug|info|warning|error|exception|critical)\(\s*\"([\w.]+)\"")
MIGRATION = re.compile(r"\bmigrations? (?P<first>\d{4})(?:-(?P<last>\d{4}))?\b")
FILE_SUFFIXES = (".log", ".py", ".sql", ".md", ".toml", ".json", ".txt", ".yaml", ".pid")


@cache
def files() -> tuple[str, ...]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return tuple(name for name in listed if (REPO / name).is_file())


def tracked() -> Iterator[tuple[str, str]]:
    for name in files():
        path = REPO / name
        if name.startswith(LEFT_OUT) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
            yield name, path.read_text(encoding="utf-8")


@cache
def ignored() -> tuple[str, ...]:
    """What .gitignore leaves out (generated: results, artifacts, the built site)."""
    lines = (REPO / ".gitignore").read_text(encoding="utf-8").splitlines()
    return tuple(
        line.strip().rstrip("/") for line in lines if "/" in line.strip("/") or line.endswith("/")
    )


def generated(doc: str) -> bool:
    path = REPO / doc
    return path.is_file() and "<!-- relay-reference:" in path.read_text(encoding="utf-8")


def anchor_of(heading: str) -> str:
    """The anchor MyST (and GitHub) give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def headings(doc: str) -> tuple[str, ...]:
    path = REPO / doc
    if not path.is_file():
        return ()
    found = []
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip().replace("`", ""))
    return tuple(found)


def resolve_doc(doc: str, citing: str) -> str:
    if doc.startswith("README"):
        return "README.md"
    if doc.startswith("CONTRIBUTING"):
        return "CONTRIBUTING.md"
    return doc


def section_exists(doc: str, section: str) -> bool:
    cited = section.strip().rstrip(".").replace("`", "").lower()
    for heading in (h.lower() for h in headings(doc)):
        if heading == cited or heading.startswith((cited + " (", cited + ":")):
            return True
    return False


@cache
def migration_versions() -> frozenset[str]:
    return frozenset(p.name[:4] for p in (REPO / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql"))


@cache
def log_events() -> frozenset[str]:
    events: set[str] = set()
    for path in (REPO / "relay").rglob("*.py"):
        events |= set(LOG_EVENT.findall(path.read_text(encoding="utf-8")))
    return frozenset(events)


@cache
def module_name_exists(name: str) -> bool:
    parts = name.split(".")
    if "__main__" in parts:  # importing it would run the command line
        return (REPO / "/".join(parts[: parts.index("__main__") + 1])).with_suffix(".py").is_file()
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            target: object = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def citations() -> Iterator[tuple[str, int, str, str]]:
    """(file, line, kind, what) for every citation that points nowhere."""
    for name, text in tracked():
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            # A citation may wrap: read the next line on, without its comment marker.
            following = lines[number].lstrip(" \t#-*/>") if number < len(lines) else ""
            for m in SECTION.finditer(f"{line} {following}"):
                if m.start() >= len(line):
                    continue
                doc = resolve_doc(m["doc"], name)
                if not section_exists(doc, m["section"]):
                    yield name, number, "section", f'{doc} "{m["section"]}"'
            if name.endswith(".md"):
                for m in ANCHOR.finditer(line):
                    target = m["doc"] or name
                    if m["doc"]:
                        target = str((REPO / name).parent.joinpath(m["doc"]).resolve())
                        target = (
                            str(Path(target).relative_to(REPO))
                            if REPO.as_posix() in target
                            else target
                        )
                    if generated(target):
                        continue  # its sections are written at build time (Sphinx checks)
                    if m["anchor"] not in {anchor_of(h) for h in headings(target)}:
                        yield name, number, "anchor", f"{target}#{m['anchor']}"
            for m in FILE.finditer(line):
                path = m["path"].rstrip("/")
                if not (REPO / path).exists() and not path.startswith(ELSEWHERE + ignored()):
                    yield name, number, "file", path
            for m in MIGRATION.finditer(line):
                for version in filter(None, (m["first"], m["last"])):
                    if version not in migration_versions():
                        yield name, number, "migration", version
            for m in PARTIAL.finditer(line):
                if not any(f == m["path"] or f.endswith("/" + m["path"]) for f in files()):
                    yield name, number, "file", m["path"]
            if "get_logger(" in line or name.endswith(".sql"):
                continue  # logger names are by part; in SQL, relay.x is a schema's table
            for m in MODULE.finditer(line):
                cited = m["name"].rstrip(".")
                if cited in log_events() or cited.endswith(FILE_SUFFIXES):
                    continue
                if not module_name_exists(cited):
                    yield name, number, "module", cited


def test_every_citation_points_at_something_that_exists() -> None:
    broken = [f"{name}:{number}: {kind} {what}" for name, number, kind, what in citations()]
    assert not broken, "\n".join(broken)


def test_the_checker_finds_a_broken_citation_of_each_kind(tmp_path: Path) -> None:
    """The patterns match the forms the project writes (and would miss nothing silently)."""
    line = 'see README "No such section", relay/no_such.py, relay.no_such and x.md#nowhere)'
    assert SECTION.search(line)
    assert FILE.search(line)
    assert not module_name_exists("relay.no_such")
    assert module_name_exists("relay.drain.loop.Drainer")
    assert not section_exists("README.md", "No such section")
    assert section_exists("README.md", "Write to the outbox")
    assert ANCHOR.search(line)
    assert [m["first"] for m in MIGRATION.finditer("as migration 0015 did")] == ["0015"]
    assert "0015" not in migration_versions() and "0100" in migration_versions()
