"""The variables 1.0 renamed or removed, and what replaces each.

A deployment that still sets one must not lose it silently: start-up stops (exit 2)
naming the replacement. A value in milliseconds that became seconds says so, so the
number is converted, not copied.
"""

from __future__ import annotations

from collections.abc import Mapping

_SINK_TIMEOUT = "RELAY_SINK_TIMEOUT_SECONDS"
_SINK_IN_FLIGHT = "RELAY_SINK_MAX_IN_FLIGHT"

RETIRED: Mapping[str, str] = {
    # One name per concept across sinks.
    "RELAY_KAFKA_DELIVERY_TIMEOUT_MS": f"{_SINK_TIMEOUT} (seconds, not milliseconds)",
    "RELAY_HTTP_TIMEOUT_SECONDS": _SINK_TIMEOUT,
    "RELAY_NATS_PUBLISH_TIMEOUT_SECONDS": _SINK_TIMEOUT,
    "RELAY_RABBITMQ_PUBLISH_TIMEOUT_SECONDS": _SINK_TIMEOUT,
    "RELAY_HTTP_MAX_IN_FLIGHT": _SINK_IN_FLIGHT,
    "RELAY_NATS_MAX_IN_FLIGHT": _SINK_IN_FLIGHT,
    "RELAY_RABBITMQ_MAX_IN_FLIGHT": _SINK_IN_FLIGHT,
    "RELAY_KAFKA_TOPIC_MAP": "RELAY_TOPIC_MAP",
    "RELAY_NATS_SUBJECT_MAP": "RELAY_TOPIC_MAP",
    "RELAY_RABBITMQ_ROUTING_KEY_MAP": "RELAY_TOPIC_MAP",
    "RELAY_HTTP_CA_FILE": "RELAY_SINK_TLS_CA_FILE",
    "RELAY_NATS_TLS_CA_FILE": "RELAY_SINK_TLS_CA_FILE",
    "RELAY_RABBITMQ_TLS_CA_FILE": "RELAY_SINK_TLS_CA_FILE",
    "RELAY_HTTP_CLIENT_CERT_FILE": "RELAY_SINK_TLS_CERT_FILE",
    "RELAY_NATS_TLS_CERT_FILE": "RELAY_SINK_TLS_CERT_FILE",
    "RELAY_RABBITMQ_TLS_CERT_FILE": "RELAY_SINK_TLS_CERT_FILE",
    "RELAY_HTTP_CLIENT_KEY_FILE": "RELAY_SINK_TLS_KEY_FILE",
    "RELAY_NATS_TLS_KEY_FILE": "RELAY_SINK_TLS_KEY_FILE",
    "RELAY_RABBITMQ_TLS_KEY_FILE": "RELAY_SINK_TLS_KEY_FILE",
    # One setting for one header.
    "RELAY_HTTP_AUTH_HEADER_VALUE": (
        "RELAY_HTTP_AUTH_HEADER, name and value in one: `Authorization: <value>` (or"
        " `<RELAY_HTTP_AUTH_HEADER_NAME>: <value>`)"
    ),
    "RELAY_HTTP_AUTH_HEADER_VALUE_FILE": (
        "RELAY_HTTP_AUTH_HEADER_FILE, its file holding `Authorization: <value>` (or"
        " `<RELAY_HTTP_AUTH_HEADER_NAME>: <value>`)"
    ),
    "RELAY_HTTP_AUTH_HEADER_NAME": (
        "RELAY_HTTP_AUTH_HEADER as `<name>: <value>`; a RELAY_HTTP_TOPIC_URLS entry's own"
        " auth_header_value goes in its auth_header_name, else in RELAY_HTTP_AUTH_HEADER's"
        " name, else in Authorization"
    ),
    # Credentials a URL carries.
    "RELAY_NATS_USER": "RELAY_NATS_URL with nats://user:password@host:4222",
    "RELAY_NATS_PASSWORD": "RELAY_NATS_URL with nats://user:password@host:4222",
    "RELAY_NATS_PASSWORD_FILE": "RELAY_NATS_URL_FILE, its URL with user:password",
    "RELAY_NATS_TOKEN": "RELAY_NATS_URL with nats://token@host:4222",
    "RELAY_NATS_TOKEN_FILE": "RELAY_NATS_URL_FILE, its URL with the token",
    "RELAY_HTTP_CONNECT_TIMEOUT_SECONDS": (
        "nothing: a connection may take 5 s, or RELAY_SINK_TIMEOUT_SECONDS if shorter"
    ),
    "RELAY_DATABASE_CONNECT_TIMEOUT_SECONDS": (
        "connect_timeout in RELAY_DATABASE_URL (?connect_timeout=5, the default)"
    ),
    "RELAY_DATABASE_SSLMODE": (
        "sslmode in RELAY_DATABASE_URL (?sslmode=verify-full), and in RELAY_DATABASE_DIRECT_URL"
        " if set"
    ),
    "RELAY_DATABASE_SSLROOTCERT": (
        "sslrootcert in RELAY_DATABASE_URL (?sslmode=verify-full&sslrootcert=/path/ca.crt),"
        " and in RELAY_DATABASE_DIRECT_URL if set"
    ),
    "RELAY_DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": (
        "nothing: relay run's sessions use the lease ttl, the others 30 s"
    ),
    "RELAY_CONSOLE_SESSION_HOURS": "nothing: a console login lasts 8 hours",
    "RELAY_CONSOLE_STATEMENT_TIMEOUT_SECONDS": (
        "nothing: a console statement runs 5 s at most (less with a lower"
        " RELAY_DATABASE_STATEMENT_TIMEOUT_SECONDS)"
    ),
    # Durations in seconds everywhere.
    "RELAY_KAFKA_STRAGGLER_MS": "RELAY_KAFKA_STRAGGLER_SECONDS (seconds, not milliseconds)",
    "RELAY_DATABASE_STATEMENT_TIMEOUT_MS": (
        "RELAY_DATABASE_STATEMENT_TIMEOUT_SECONDS (seconds, not milliseconds)"
    ),
    "RELAY_DATABASE_LOCK_TIMEOUT_MS": (
        "RELAY_DATABASE_LOCK_TIMEOUT_SECONDS (seconds, not milliseconds)"
    ),
    "RELAY_DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS": (
        "nothing: relay run's sessions use the lease ttl, the others 30 s"
    ),
    "RELAY_CONSOLE_STATEMENT_TIMEOUT_MS": (
        "nothing: a console statement runs 5 s at most (less with a lower"
        " RELAY_DATABASE_STATEMENT_TIMEOUT_SECONDS)"
    ),
    # What librdkafka's pass-through already says.
    "RELAY_KAFKA_COMPRESSION": "RELAY_KAFKA__COMPRESSION_TYPE (the relay's default is lz4)",
    "RELAY_KAFKA_LINGER_MS": "RELAY_KAFKA__LINGER_MS (the relay's default is 5)",
    "RELAY_KAFKA_SECURITY_PROTOCOL": "RELAY_KAFKA__SECURITY_PROTOCOL",
    "RELAY_KAFKA_SASL_MECHANISM": "RELAY_KAFKA__SASL_MECHANISM",
    "RELAY_KAFKA_SASL_USERNAME": "RELAY_KAFKA__SASL_USERNAME",
    "RELAY_KAFKA_SASL_PASSWORD": "RELAY_KAFKA__SASL_PASSWORD",
    "RELAY_KAFKA_SASL_PASSWORD_FILE": "RELAY_KAFKA__SASL_PASSWORD_FILE",
    # The console's fixed bounds.
    "RELAY_CONSOLE_PAGE_SIZE": "nothing: a page shows 50 rows",
    "RELAY_CONSOLE_PAYLOAD_PREVIEW_BYTES": "nothing: a row's page shows 64 KiB of its payload",
    "RELAY_CONSOLE_COUNT_CAP": "nothing: the console's counts stop at 100,000",
    "RELAY_CONSOLE_BULK_CAP": "nothing: one requeue or discard changes 100,000 rows at most",
    "RELAY_CONSOLE_RATE_WINDOW_SECONDS": "nothing: the settled rate is over 5 minutes",
    "RELAY_CONSOLE_POOL_SIZE": "nothing: the console keeps 4 database sessions",
    "RELAY_CLOUDEVENTS": "RELAY_CLOUDEVENTS_SOURCE alone: set, it sends CloudEvents (binary mode)",
    "RELAY_CLOUDEVENTS_TYPE_HEADER": "nothing: the event type is the row's `type` header",
    "RELAY_HTTP_READ_TIMEOUT_SECONDS": (
        f"{_SINK_TIMEOUT}: a request may go 10 s (at most that) without a byte moving"
    ),
    "RELAY_LAG_COUNT_CAP": "nothing: the lag gauges count up to 100,000 rows",
    "RELAY_PURGE_BATCH_SIZE": "nothing: the purge deletes 1,000 rows a statement",
    "RELAY_METRICS_ENABLED": (
        "RELAY_METRICS_PORT: 0 serves no metrics and no probes (false); a port serves them"
    ),
    # Derived from the lease's ttl, and never needed on their own.
    "RELAY_STANDBY_POLL_SECONDS": (
        "nothing: a standby tries every fifteenth of RELAY_LEASE_TTL_SECONDS (at most 0.5 s)"
    ),
    "RELAY_HEARTBEAT_SECONDS": (
        "nothing: a replica beats every fifth of RELAY_LEASE_TTL_SECONDS (at most 2 s)"
    ),
    "RELAY_LEASE_RENEW_INTERVAL_SECONDS": (
        "nothing: a leader renews every third of RELAY_LEASE_TTL_SECONDS"
    ),
    "RELAY_LEASE_SAFETY_MARGIN_SECONDS": (
        "nothing: a leader stops a fifth of RELAY_LEASE_TTL_SECONDS (at most 2 s) early"
    ),
}


def replacement(variable: str) -> str | None:
    """What replaces `variable` (any case), or None if 1.0 kept it."""
    return RETIRED.get(variable.upper())
