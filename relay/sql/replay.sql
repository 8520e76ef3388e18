-- Replay (`relay replay`, relay/admin/replay.py, and the console's replay): rows kept as
-- sent in outbox_sent (RELAY_RETENTION_SECONDS) put back into the outbox as new rows.
-- The copy and its audit entry are one statement of the function outbox_replay
-- (migrations/0100_schema.sql), which runs as the tables' owner; what it copies and when it refuses
-- is written there. Parameters are named, %(name)s; nothing here is built by string
-- concatenation.

-- name: replay
-- One replay, or (%(max_rows)s 0) only its count: the rows of topic %(topic)s (and key
-- %(key)s, NULL: any) sent from a time up to another, by the database clock: %(since)s,
-- or %(since_ago)s seconds before now(); %(until)s, or %(until_ago)s seconds before
-- now(), or (both NULL) now(). %(expected)s: copy only if exactly that many rows match
-- (NULL: any number up to %(max_rows)s). The audit entry names %(actor)s and %(via)s
-- (`cli` or `console`). Returns the history's span, the range as used, how many rows
-- match, and for a replay made its id (its audit entry's, and the `relay-replay`
-- header's value), how many rows went in, and the first and last new id.
SELECT asked.sent_from, done.sent_until, done.kept_since, done.kept_until, done.matching,
       done.replay_id, done.replayed, done.first_id, done.last_id
FROM (SELECT coalesce(%(since)s::timestamptz,
                      now() - make_interval(secs => %(since_ago)s::float8)) AS sent_from,
             coalesce(%(until)s::timestamptz,
                      now() - make_interval(secs => coalesce(%(until_ago)s::float8, 0)))
                 AS sent_before) AS asked
CROSS JOIN LATERAL outbox_replay(%(topic)s::text, %(key)s::text, asked.sent_from,
                                 asked.sent_before, %(max_rows)s::bigint,
                                 %(expected)s::bigint, %(actor)s::text, %(via)s::text)
    AS done;
