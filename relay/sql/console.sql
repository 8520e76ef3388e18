-- What the operators' console (`relay console`, relay/console/) reads and writes, beside
-- the statements it shares with the CLI (operations.sql: lease_status, replica_status,
-- lag_sample, dead_letter_requeue, dead_letters_left_behind). Dead letters are read
-- through outbox_dead_letters (an own table's view schema has its own).
-- The console is a process of its own under its own role (migrations/console_grants.sql);
-- nothing here runs in the drain. Parameters are named, %(name)s; nothing is built by
-- string concatenation.

------------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------------

-- fragment: dead_letter_filter
-- The console's search: every part optional (NULL matches all). Topic and key match
-- exactly, the reason as a case-insensitive substring, the time as a half-open range.
(%(topic)s::text IS NULL OR topic = %(topic)s::text)
AND (%(key)s::text IS NULL OR key = %(key)s::text)
AND (%(reason)s::text IS NULL
     OR strpos(lower(dead_letter_reason), lower(%(reason)s::text)) > 0)
AND (%(since)s::timestamptz IS NULL OR dead_lettered_at >= %(since)s::timestamptz)
AND (%(until)s::timestamptz IS NULL OR dead_lettered_at < %(until)s::timestamptz)

-- fragment: dead_letter_line
-- A dead letter as a page lists it.
id, message_id, topic, key, attempts, dead_lettered_at, dead_letter_reason,
octet_length(payload) AS payload_bytes

-- name: console_dead_letter_page_after
-- One page of dead letters after a keyset cursor (id), oldest first: a walk of
-- outbox_dead's primary key (an own table's: of its index on its dead letters) from the
-- cursor, stopping at the page size; so a deep page costs what the first does, however
-- many dead letters there are.
SELECT {{dead_letter_line}}
FROM outbox_dead_letters
WHERE id > %(after)s::bigint
  AND {{dead_letter_filter}}
ORDER BY id
LIMIT %(limit)s;

-- name: console_dead_letter_page_before
-- The page before a cursor (the same walk, backwards); the caller reverses it.
SELECT {{dead_letter_line}}
FROM outbox_dead_letters
WHERE id < %(before)s::bigint
  AND {{dead_letter_filter}}
ORDER BY id DESC
LIMIT %(limit)s;

-- name: console_dead_letter_count
-- How many dead letters match, counted up to a cap (the list shows "at least").
SELECT count(*) AS matching
FROM (SELECT 1
        FROM outbox_dead_letters
       WHERE {{dead_letter_filter}}
       LIMIT %(cap)s) AS matched;

-- name: console_dead_letter_ids
-- Every dead letter a filter matches, in id order: what a requeue or discard by filter
-- is about to change (its confirmation states how many), up to a cap.
SELECT id
FROM outbox_dead_letters
WHERE {{dead_letter_filter}}
ORDER BY id
LIMIT %(cap)s;

-- name: console_dead_letters_of
-- Which of the given rows are dead-lettered (a selection, checked before confirming).
SELECT id
FROM outbox_dead_letters
WHERE id = ANY(%(ids)s::bigint[])
ORDER BY id;

-- name: console_discard
-- A discard: delete dead letters, never any other row (a row requeued since the
-- confirmation stays). The rows are gone for good; the audit keeps every id deleted
-- (console_audit.row_ids), beside the ids chosen or the search.
DELETE FROM outbox_dead
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id;

-- name: console_discard_in_place
-- console_discard for an own table (RELAY_OUTBOX_TABLE), whose dead letters stay in it,
-- marked: through the view of all its rows, outbox_marked.
DELETE FROM outbox_marked
WHERE dead_lettered_at IS NOT NULL
  AND id = ANY(%(ids)s::bigint[])
RETURNING id;

------------------------------------------------------------------------------------
-- Rows and keys
------------------------------------------------------------------------------------

-- name: console_row
-- One outbox row for its page, with at most %(preview)s bytes of its payload (and the
-- payload's whole size), so a huge payload is never read whole into the console: a row
-- still in the outbox, a dead letter, or a row scheduled for later, moved out until due.
-- A row parked for a paused topic (next_attempt_at 'infinity', which Python's datetime
-- cannot hold) shows no next attempt.
SELECT id, message_id, topic, key, headers,
       substring(payload FROM 1 FOR %(preview)s) AS payload,
       octet_length(payload) AS payload_bytes,
       created_at, available_at, promoted_at, attempts,
       nullif(next_attempt_at, 'infinity') AS next_attempt_at,
       last_error, NULL::timestamptz AS dead_lettered_at, NULL::text AS dead_letter_reason
FROM outbox
WHERE id = %(id)s::bigint
UNION ALL
SELECT id, message_id, topic, key, headers,
       substring(payload FROM 1 FOR %(preview)s),
       octet_length(payload),
       created_at, available_at, promoted_at, attempts, NULL,
       last_error, dead_lettered_at, dead_letter_reason
FROM outbox_dead_letters
WHERE id = %(id)s::bigint
  AND NOT EXISTS (SELECT 1 FROM outbox WHERE id = %(id)s::bigint)
UNION ALL
SELECT id, message_id, topic, key, headers,
       substring(payload FROM 1 FOR %(preview)s),
       octet_length(payload),
       created_at, available_at, NULL, attempts, NULL,
       last_error, NULL, NULL
FROM outbox_scheduled
WHERE id = %(id)s::bigint;

-- name: console_blocked_keys
-- Keys in backoff: each failing row (the head of its key, waiting out next_attempt_at,
-- found through outbox_waiting_idx), with how many later rows of its key wait
-- behind it (counted through outbox_key_hash_idx, up to a cap).
SELECT {{blocked_key}},
       (SELECT count(*)
          FROM (SELECT 1 FROM outbox AS w
                 WHERE outbox_key_hash(w.key) = outbox_key_hash(f.key)
                   AND w.key = f.key AND w.id > f.id
                   AND (w.available_at IS NULL OR w.promoted_at IS NOT NULL)
                 LIMIT %(cap)s) AS behind)
        AS waiting_behind
{{blocked_keys_from}};

-- name: console_blocked_keys_uncounted
-- console_blocked_keys without the count, where the outbox has no key index
-- (`relay migrate --without-key-index`): each count would walk the rest of the outbox.
SELECT {{blocked_key}},
       NULL::bigint AS waiting_behind
{{blocked_keys_from}};

-- name: console_blocked_keys_counted
-- Whether console_blocked_keys can count: the relay's outbox with its key index, or an
-- own table's view (`--own-table` always builds the table's key index).
SELECT c.relkind = 'v'
       OR EXISTS (SELECT 1
                  FROM pg_index AS i
                  JOIN pg_class AS x ON x.oid = i.indexrelid
                  WHERE i.indrelid = c.oid
                    AND x.relname = 'outbox_key_hash_idx'
                    AND i.indisvalid) AS counted
FROM pg_class AS c
WHERE c.oid = 'outbox'::regclass;

-- fragment: blocked_key
-- A blocked key's head row, as the console shows it.
f.key, f.id, f.topic, f.attempts, f.next_attempt_at, f.last_error,
extract(epoch FROM f.next_attempt_at - now())::float8 AS next_attempt_in_seconds

-- fragment: blocked_keys_from
-- The failing rows, in id order, up to %(limit)s (a row parked for a paused topic is
-- not failing: the console lists paused topics apart).
FROM outbox AS f
WHERE f.attempts > 0 AND f.next_attempt_at IS NOT NULL AND f.next_attempt_at < 'infinity'
ORDER BY f.id
LIMIT %(limit)s

------------------------------------------------------------------------------------
-- Rate
------------------------------------------------------------------------------------

-- name: console_settled_counters
-- What the console samples to show a settled rate: PostgreSQL's count of the outbox's
-- deletions (pg_stat_user_tables, which counts purges and requeues' moves too; rows
-- moved into outbox_sent count, since retention moves them), less the rows moved out of
-- it into outbox_dead (dead letters) and outbox_scheduled (rows scheduled for later),
-- each of which counts one insertion there.
SELECT (SELECT o.n_tup_del - coalesce(d.n_tup_ins, 0) - coalesce(s.n_tup_ins, 0)
          FROM pg_stat_user_tables AS o
          LEFT JOIN pg_stat_user_tables AS d ON d.relid = to_regclass('outbox_dead')
          LEFT JOIN pg_stat_user_tables AS s ON s.relid = to_regclass('outbox_scheduled')
         WHERE o.relid = to_regclass('outbox')) AS deleted,
       0::bigint AS sent_in_window,
       extract(epoch FROM now())::float8 AS at;

-- name: console_settled_counters_marked
-- console_settled_counters for an own table (RELAY_OUTBOX_TABLE): no statistics for its
-- view, and rows kept (RELAY_RETENTION_SECONDS > 0) stay in it, marked: counted by
-- sent_at in the window, through the view of all its rows (outbox_marked) and its index
-- on relay_sent_at, up to a cap.
SELECT NULL::bigint AS deleted,
       (SELECT count(*)
          FROM (SELECT 1 FROM outbox_marked
                 WHERE sent_at IS NOT NULL
                   AND sent_at > now() - make_interval(secs => %(window)s)
                 LIMIT %(cap)s) AS sent) AS sent_in_window,
       extract(epoch FROM now())::float8 AS at;

------------------------------------------------------------------------------------
-- Audit
------------------------------------------------------------------------------------

-- name: console_audit_record
-- One requeue or discard, in the transaction that made it, with every id it changed.
INSERT INTO console_audit (actor, action, target, row_count, first_id, last_id, row_ids,
                           note)
VALUES (%(actor)s, %(action)s, %(target)s::jsonb, %(row_count)s, %(first_id)s,
        %(last_id)s, %(row_ids)s::bigint[], %(note)s)
RETURNING id;

-- name: console_audit_page
-- The newest entries first, before a keyset cursor (NULL: from the newest).
SELECT id, at, actor, action, target, row_count, first_id, last_id, note
FROM console_audit
WHERE %(before)s::bigint IS NULL OR id < %(before)s::bigint
ORDER BY id DESC
LIMIT %(limit)s;

-- name: console_audit_entry
-- One entry, with how many row ids it recorded and the first %(shown)s of them (NULL
-- both for an entry recorded without them).
SELECT id, at, actor, action, target, row_count, first_id, last_id, note,
       cardinality(row_ids) AS row_ids_count,
       row_ids[1:%(shown)s::integer] AS row_ids_shown
FROM console_audit
WHERE id = %(id)s::bigint;

------------------------------------------------------------------------------------
-- Overview
------------------------------------------------------------------------------------

-- name: console_blocked_key_count
-- Keys in backoff (their failing head rows, through outbox_waiting_idx), up to a cap;
-- not those parked for a paused topic.
SELECT count(DISTINCT key) AS blocked_keys
FROM (SELECT key
        FROM outbox
       WHERE attempts > 0 AND next_attempt_at IS NOT NULL AND next_attempt_at < 'infinity'
       LIMIT %(cap)s) AS failing;
