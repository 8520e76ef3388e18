"""`relay console`: the operators' web console, a process of its own beside the replicas.

It reads the database the relay drains (leases, heartbeats, lag, dead letters, keys in
backoff) and makes the changes `relay dead-letter requeue` makes, plus discards, each
recorded in `console_audit`. Nothing in the drain imports it (an import-linter
contract), and it imports nothing of the drain: a console outage never touches delivery.

Modules, one job each: `settings` (RELAY_CONSOLE_*), `auth` (sessions, CSRF, the proxy
header, bearer tokens), `hosts` (the Host allow-list and the Origin check), `pool`
(database sessions), `data` (the database: named statements and the repository's
functions), `render` (payloads, times, the templates), `app` (routes), `api` (the JSON
API for scripts, /api/v1/), `api_input` (its query strings and bodies), `replies` (its
JSON answers), `server` (uvicorn).
"""
