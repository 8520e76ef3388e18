"""What the console reads from a query string or a form: numbers, times, a search,
the rows an operator chose, and where to go after logging in. A value that does not
parse raises ValueError (the page answers 400)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import FormData

from relay.admin import replay
from relay.console import data

BIGINT_MAX = (1 << 63) - 1


def int_param(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    value = int(text)
    if not 0 <= value <= BIGINT_MAX:
        raise ValueError(f"{text[:40]!r} is out of range")
    return value


def is_bigint(value: int) -> bool:
    """Whether a path's id can be a row's (bigint); a bigger one is no row, not a 500."""
    return 0 <= value <= BIGINT_MAX


def time_param(text: str | None) -> datetime | None:
    if not text:
        return None
    value = datetime.fromisoformat(text)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def search_filter(source: Mapping[str, Any]) -> data.Filter:
    def text(name: str) -> str | None:
        value = source.get(name)
        if isinstance(value, str) and "\0" in value:
            # PostgreSQL text cannot hold NUL: the query would fail (a 500), not match.
            raise ValueError(f"{name} holds a NUL character")
        return value.strip() or None if isinstance(value, str) else None

    return data.Filter(
        topic=text("topic"),
        key=text("key"),
        reason=text("reason"),
        since=time_param(text("since")),
        until=time_param(text("until")),
    )


def search_fields(search: data.Filter) -> list[tuple[str, str]]:
    return list(search.as_json().items())


def search_query(search: data.Filter) -> dict[str, str]:
    return search.as_json()


def url(path: str, base: Mapping[str, str], **extra: Any) -> str:
    return f"{path}?{urlencode({**base, **{k: str(v) for k, v in extra.items()}})}"


def page_links(base: Mapping[str, str], page: data.Page) -> dict[str, Any]:
    """The dead-letter page's Next and Previous links (None: no such page)."""
    first, last = (page.rows[0]["id"], page.rows[-1]["id"]) if page.rows else (None, None)
    return {
        "next_url": url("/dead-letters", base, after=last) if page.more_after else None,
        "prev_url": url("/dead-letters", base, before=first) if page.more_before else None,
    }


def action_of(form: FormData) -> data.Action | None:
    action = form.get("action")
    if action == "requeue":
        return "requeue"
    if action == "discard":
        return "discard"
    return None


def target_of(form: FormData) -> data.Target:
    """Rows by id (`id`, repeated), or every dead letter a search matches (`scope` =
    filter, with the search's fields)."""
    if form.get("scope") == "filter":
        return data.Target(search=search_filter(form))
    ids = ids_of([v for v in form.getlist("id") if isinstance(v, str)])
    if not ids:
        raise ValueError("no rows chosen")
    return data.Target(ids=ids)


def replay_request(form: Mapping[str, Any]) -> replay.Request:
    """A replay's filter: a topic and a start (required), an end and a key (optional);
    times as `time_param` reads them (UTC without an offset)."""

    def text(name: str) -> str | None:
        value = form.get(name)
        if not isinstance(value, str) or not value.strip():
            return None
        if "\0" in value:
            raise ValueError(f"{name} holds a NUL character")
        return value.strip()

    topic, since = text("topic"), time_param(text("since"))
    if topic is None or since is None:
        raise ValueError("a replay needs a topic and a start time")
    return replay.Request(
        topic=topic, since=since, until=time_param(text("until")), key=text("key")
    )


def ids_of(values: Sequence[str]) -> tuple[int, ...]:
    """Row ids as posted; one that is not a bigint raises ValueError (a 400, where the
    database would refuse it with a 500)."""
    found: set[int] = set()
    for value in values:
        number = int(value) if value.isascii() and value.isdigit() and len(value) < 20 else -1
        if not 0 <= number < 1 << 63:
            raise ValueError(f"{value[:40]!r} is not a row id")
        found.add(number)
    return tuple(sorted(found))


def local_path(target: str | None) -> str:
    """Where to go after logging in: a path of this console only (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target
