"""What the API reads from a query string or a JSON body: a dead-letter search, a
cursor, the rows a change names, a pause, a replay. Stricter than the forms
(relay/console/forms.py): a name the API does not know is refused, not ignored, because
a script's misspelt filter field would otherwise widen a change to every dead letter. A
value that does not parse raises ValueError (the API answers 400)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.admin import pauses, replay, times
from relay.console import data, forms

FILTER_FIELDS = ("topic", "key", "reason", "since", "until")
LIST_PARAMS = frozenset({*FILTER_FIELDS, "after", "limit"})
CHANGE_FIELDS = frozenset({"ids", "filter", "expected", "digest", "dry_run"})
MOST_PER_PAGE = 500  # a page's rows at most (`limit`); the default is the console's page


@dataclass(frozen=True, slots=True)
class Listing:
    search: data.Filter
    after: int | None
    limit: int


def listing(query: Sequence[tuple[str, str]], default_limit: int) -> Listing:
    """`GET /api/v1/dead-letters`'s parameters: the console's search, `after` (the
    previous page's `next`) and `limit`."""
    given = _once(query)
    unknown = sorted(set(given) - LIST_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(map(repr, unknown))}")
    limit = forms.int_param(given.get("limit"))
    if limit is not None and not 1 <= limit <= MOST_PER_PAGE:
        raise ValueError(f"limit must be between 1 and {MOST_PER_PAGE}")
    return Listing(
        search=forms.search_filter(given),
        after=forms.int_param(given.get("after")),
        limit=default_limit if limit is None else limit,
    )


def _once(query: Sequence[tuple[str, str]]) -> dict[str, str]:
    given: dict[str, str] = {}
    for name, value in query:
        if name in given:
            raise ValueError(f"parameter {name!r} given twice")
        given[name] = value
    return given


@dataclass(frozen=True, slots=True)
class ChangeRequest:
    """A requeue or discard as a script asks for it: rows by id, or every dead letter a
    filter matches with how many (`expected`) and, optionally, which (`digest`) the
    script means; `dry_run` changes nothing and says what would change."""

    target: data.Target
    expected: int | None = None
    digest: str | None = None
    dry_run: bool = False


def parse_body(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # a bad UTF-8 or JSON text; nesting too deep
        raise ValueError("the body is not a JSON document") from None


def change_request(body: object) -> ChangeRequest:
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"ids": [...]} or {"filter": {...}}')
    unknown = sorted(set(body) - CHANGE_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ValueError("dry_run must be true or false")
    if ("ids" in body) == ("filter" in body):
        raise ValueError('name the rows by "ids" or by "filter", one of them')
    if "ids" in body:
        if "expected" in body or "digest" in body:
            raise ValueError('"ids" name their rows: "expected" and "digest" go with "filter"')
        return ChangeRequest(data.Target(ids=_ids(body["ids"])), dry_run=dry_run)
    return ChangeRequest(
        data.Target(search=_filter(body["filter"])),
        expected=_expected(body.get("expected")),
        digest=_digest(body.get("digest")),
        dry_run=dry_run,
    )


def _ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError('"ids" must be a non-empty list of row ids')
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError('"ids" must hold integers only')
    return forms.ids_of([str(v) for v in value])


def _filter(value: Any) -> data.Filter:
    if not isinstance(value, dict):
        raise ValueError(f'"filter" must be an object of {", ".join(FILTER_FIELDS)}')
    fields: Mapping[str, Any] = value
    unknown = sorted(set(fields) - set(FILTER_FIELDS))
    if unknown:
        raise ValueError(f"unknown filter field(s) {', '.join(map(repr, unknown))}")
    for name, given in fields.items():
        if given is not None and not isinstance(given, str):
            raise ValueError(f"filter field {name!r} must be a string")
    return forms.search_filter(fields)


def _expected(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError('"expected" must be a count (an integer, 0 or more)')
    return value


def _digest(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError('"digest" must be the digest a dry run answered')
    return value


PAUSE_FIELDS = frozenset({"topic", "reason"})
REPLAY_FIELDS = frozenset({"topic", "since", "until", "key", "expected", "dry_run"})


@dataclass(frozen=True, slots=True)
class PauseRequest:
    topic: str
    reason: str | None = None


def pause_request(body: object, *, reason: bool = True) -> PauseRequest:
    """`POST /api/v1/pause` (`reason` allowed) or `/resume`: `{"topic": ...}`."""
    fields = PAUSE_FIELDS if reason else frozenset({"topic"})
    given = _object(body, fields, '{"topic": "..."}')
    topic = _text(given, "topic", strip=False)  # a topic is exact
    if topic is None:
        raise ValueError('"topic" is required')
    problem = pauses.topic_problem(topic)
    if problem is not None:
        raise ValueError(problem)
    return PauseRequest(topic, _text(given, "reason"))


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """`POST /api/v1/replay`: `relay replay`'s fields; the count a dry run answered as
    `expected` to replay (else nothing is replayed: the answer states the count)."""

    request: replay.Request
    expected: int | None = None
    dry_run: bool = False


def replay_request(body: object) -> ReplayRequest:
    given = _object(body, REPLAY_FIELDS, '{"topic": "...", "since": "2h"}')
    topic, since = _text(given, "topic"), _text(given, "since")
    if topic is None or since is None:
        raise ValueError('a replay needs "topic" and "since"')
    until = _text(given, "until")
    dry_run = given.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise ValueError("dry_run must be true or false")
    asked = replay.Request(
        topic=topic,
        since=times.instant_or_ago(since),
        until=None if until is None else times.instant_or_ago(until),
        key=_text(given, "key"),
    )
    return ReplayRequest(asked, _expected(given.get("expected")), dry_run)


def _object(body: object, fields: frozenset[str], shape: str) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object: {shape}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
    return body


def _text(given: Mapping[str, Any], name: str, *, strip: bool = True) -> str | None:
    value = given.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name!r} must be a string")
    if "\0" in value:
        raise ValueError(f"{name!r} holds a NUL character")
    if not strip:
        return value
    return value.strip() or None
