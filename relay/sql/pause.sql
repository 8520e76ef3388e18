-- Pausing a topic (`relay pause` and `relay resume`, relay/admin/pauses.py, the
-- console and its API): the change and its audit entry are one call of outbox_pause or
-- outbox_resume (migrations/0100_schema.sql), which run as the tables' owner. What the
-- drain does with a paused topic's rows is relay/sql/drain.sql's (park_paused,
-- unpark_resumed). Parameters are named, %(name)s.

-- name: pause
-- Pause topic %(topic)s, recorded for %(actor)s via %(via)s (`cli`, `console`, `api`)
-- with %(reason)s (NULL: none given): whether it was paused now (false: it was already),
-- since when it is paused, and the audit entry's id.
SELECT p.paused_now, p.paused_since, p.audit_id
FROM outbox_pause(%(topic)s::text, %(actor)s::text, %(reason)s::text, %(via)s::text) AS p;

-- name: resume
-- Resume topic %(topic)s, recorded for %(actor)s via %(via)s: whether it was paused,
-- since when it was, and the audit entry's id. The drains let its rows go within a
-- pass (about a second).
SELECT r.resumed, r.paused_since, r.audit_id
FROM outbox_resume(%(topic)s::text, %(actor)s::text, %(via)s::text) AS r;

-- name: paused_topic_list
-- Every paused topic, who paused it, since when and why, and how many of its rows are
-- held: moved into outbox_paused (each by its index on (topic, id)), or parked in the
-- outbox (an own table's: each the first waiting row of its key; the later rows of
-- those keys wait behind them and are not counted). The rows a drain has not met yet
-- are not counted either: `relay status`, the console, the API.
SELECT p.topic, p.paused_by, p.paused_at, p.reason,
       (SELECT count(*)
          FROM outbox AS o
         WHERE (o.next_attempt_at IS NOT NULL
                OR (o.available_at IS NOT NULL AND o.promoted_at IS NULL))
           AND o.next_attempt_at = 'infinity'
           AND o.topic = p.topic)
       + (SELECT count(*) FROM outbox_paused AS h WHERE h.topic = p.topic) AS held_rows
FROM outbox_paused_topics AS p
ORDER BY p.paused_at, p.topic;
