"""Where the HTTP sink sends: each configured URL with the credentials that go with it.

The global credentials (RELAY_HTTP_AUTH_HEADER, RELAY_HTTP_SIGNING_SECRET) were
given for RELAY_HTTP_URL's server: they go to its origin (scheme, host, port), and to a
RELAY_HTTP_TOPIC_URLS entry elsewhere only if it opts in; an entry may have its own.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pydantic import SecretStr

from relay.errors import SettingsError
from relay.setting_checks import is_loopback

if TYPE_CHECKING:  # the settings module checks its values with these
    from relay.sinks.http.settings import AuthHeader, HttpSettings, TopicUrl


Origin = tuple[str, str, int]  # scheme, host, port


def url_origin(url: str) -> Origin:
    """(scheme, host, port) of an endpoint URL: what one connection pool talks to."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname or "", port


def origin_name(origin: Origin) -> str:
    """`https://host:443`: an origin as logs and metric labels show it."""
    scheme, host, port = origin
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def configured_origins(settings: HttpSettings) -> set[Origin]:
    return {url_origin(d.url) for d in destinations(settings).values()}


def origin_limits(settings: HttpSettings) -> dict[Origin, float | None]:
    """Every configured origin's limit in requests a second (None: none): the one its
    RELAY_HTTP_TOPIC_URLS entries set, else RELAY_HTTP_MAX_REQUESTS_PER_SECOND. An origin
    has one budget, so entries on one origin must agree."""
    default = settings.http_max_requests_per_second
    limits: dict[Origin, float | None] = dict.fromkeys(configured_origins(settings), default)
    set_by: dict[Origin, str] = {}
    for topic, entry in settings.http_topic_urls.items():
        if entry.max_requests_per_second is None:
            continue
        origin = url_origin(entry.url)
        if origin in set_by and limits[origin] != entry.max_requests_per_second:
            raise SettingsError(
                "RELAY_HTTP_TOPIC_URLS",
                f"topics {set_by[origin]!r} and {topic!r} are on one origin (scheme, host,"
                " port) with different max_requests_per_second: an origin has one budget",
            )
        set_by[origin] = topic
        limits[origin] = entry.max_requests_per_second
    return limits


@dataclass(frozen=True, slots=True)
class Destination:
    """A configured URL and the credentials that go with it."""

    setting: str  # the variable that configures it, for errors
    label: str  # which entry of it: "" or "topic 'orders': "
    url: str
    auth: tuple[str, SecretStr] | None  # header name, value
    signing_secret: SecretStr | None


def destinations(settings: HttpSettings) -> dict[str | None, Destination]:
    """Every configured URL by topic (None: RELAY_HTTP_URL, for the other topics), with
    its credentials."""
    from relay.sinks.http.settings import auth_header

    home = auth_header(settings)
    found: dict[str | None, Destination] = {}
    if settings.http_url is not None:
        found[None] = Destination(
            "RELAY_HTTP_URL",
            "",
            settings.http_url,
            None if home is None else (home.name, home.value),
            settings.http_signing_secret,
        )
    for topic, entry in settings.http_topic_urls.items():
        found[topic] = _topic_destination(settings, home, topic, entry)
    return found


def _topic_destination(
    settings: HttpSettings, home: AuthHeader | None, topic: str, entry: TopicUrl
) -> Destination:
    """A topic URL's credentials: its own, else the global ones if it may have them. Its
    own value without a name goes in the global header's name (unset: Authorization);
    the global value, shared, goes in the entry's own name if it gives one."""
    shared = _shares_credentials(settings, entry)
    home_value = None if home is None else home.value
    value = entry.auth_header_value or (home_value if shared else None)
    return Destination(
        "RELAY_HTTP_TOPIC_URLS",
        f"topic {topic!r}: ",
        entry.url,
        _auth(entry.auth_header_name or settings.http_auth_header_name, value),
        entry.signing_secret or (settings.http_signing_secret if shared else None),
    )


def _shares_credentials(settings: HttpSettings, entry: TopicUrl) -> bool:
    """The global credentials were given for RELAY_HTTP_URL's server: a topic URL on
    that same origin gets them, one elsewhere only if it opts in."""
    if entry.share_credentials:
        return True
    return settings.http_url is not None and url_origin(entry.url) == url_origin(settings.http_url)


def _auth(name: str, value: SecretStr | None) -> tuple[str, SecretStr] | None:
    return None if value is None else (name, value)


def check_credentials_go_somewhere(settings: HttpSettings, found: Collection[Destination]) -> None:
    """A global credential no destination gets is a mistake to hear of at start-up (say
    RELAY_HTTP_URL was dropped), not from an endpoint's 401s."""
    from relay.sinks.http.settings import auth_header

    home = auth_header(settings)
    auth_sent = [d.auth[1] for d in found if d.auth is not None]
    _check_sent("RELAY_HTTP_AUTH_HEADER", None if home is None else home.value, auth_sent)
    keys_sent = [d.signing_secret for d in found]
    _check_sent("RELAY_HTTP_SIGNING_SECRET", settings.http_signing_secret, keys_sent)


def _check_sent(
    variable: str, secret: SecretStr | None, sent: Collection[SecretStr | None]
) -> None:
    """`secret` is among `sent`: the very object, as a topic's own is another."""
    if secret is not None and not any(s is secret for s in sent):
        raise SettingsError(
            variable,
            "goes to no destination: it is sent to RELAY_HTTP_URL's origin, and to a"
            " RELAY_HTTP_TOPIC_URLS entry on another origin only with share_credentials",
        )


def check_not_plaintext(destination: Destination) -> None:
    """Credentials over http:// can be read on the way, unless it stays on the host."""
    parts = urlsplit(destination.url)
    if parts.scheme != "http" or is_loopback(parts.hostname or ""):
        return
    if destination.auth is not None:
        carried = f"the {destination.auth[0]} header"
    elif parts.username is not None:
        carried = "the user:password in the URL"
    else:
        return
    raise SettingsError(
        destination.setting,
        f"{destination.label}an http:// URL to a host other than loopback would send"
        f" {carried} in plaintext: use https://, or set"
        " RELAY_HTTP_ALLOW_PLAINTEXT_CREDENTIALS=true",
    )
