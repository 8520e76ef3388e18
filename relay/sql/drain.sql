-- The drain's hot path (relay/store/fetch.py and relay/store/repository.py for
-- relay/drain/loop.py): the fetch, the promotion of scheduled rows and the settles. The
-- drain session's planner settings are relay/store/db.py's CUSTOM_PLANS and ORDERED_WALKS.
-- Parameters are named, %(name)s; nothing here is built by string concatenation.

------------------------------------------------------------------------------------
-- Fetching
--
-- A rule the fetches (and the promotion) share is written once, as a fragment: a
-- statement's {{name}} is the text under `-- fragment: name`, put in its place when
-- relay/sql/__init__.py loads this file, so the server plans it as if it were written out.
-- The fragments read the candidate row as `o`, the fetched row as `m`. fetch_batch is
-- too long to read at once, so it is an outline of CTEs whose longer bodies are
-- fragments, written after it, a page each (they use the shared ones too).
------------------------------------------------------------------------------------

-- fragment: this_shard
-- With %(shards)s > 1 (RELAY_SHARDS), shard %(shard)s's rows only, read
-- through the per-count indexes `relay migrate --shards N` creates
-- (outbox_shards_N_due_idx, outbox_shards_N_due_key_hash_idx): under a custom plan the count
-- is a constant, so the expression matches theirs. With one shard the test folds away.
(%(shards)s::integer = 1 OR outbox_shard(o.key, o.id, %(shards)s::integer) = %(shard)s::integer)

-- fragment: header_facts
-- What the fetch needs of a candidate row's (`o`) headers, from one walk of them (a
-- walk per need cost three times as much), as one outbox_header_facts (a type of the
-- schema's); NULL for headers that are no object (jsonb_each would fail on them), without
-- running the walk at all. bytes: their size in row_size, each header its name and its
-- value as text, never the whole headers printed as JSON (a value of control
-- characters prints six times its size, past what one text can hold: the fetch would
-- fail for good); an array or object value counts as stored: such a row is
-- dead-lettered anyway. refused: why the first header whose value is an array or
-- object cannot be sent (unsendable). pairs: the headers to send as [name, value] text
-- pairs (a flat array takes a second set-returning function per header), each value
-- as PostgreSQL prints it (headers->>'name'), nulls and the relay's own names left
-- out: never parsed by Python (a value Python's json cannot load cannot hurt the
-- relay). Header order carries no meaning: "first" and the pairs' order are jsonb's
-- own key order, in which array_agg reads the function scan.
CASE WHEN jsonb_typeof(o.headers) = 'object' THEN
    (SELECT ROW(coalesce(sum(octet_length(header.key)
                             + CASE WHEN jsonb_typeof(header.value) IN ('object', 'array')
                                    THEN pg_column_size(header.value)
                                    ELSE coalesce(octet_length(header.value #>> '{}'), 0)
                               END), 0),
                (array_agg('header ' || to_jsonb(header.key)::text
                           || ' must be a string or scalar, got '
                           || jsonb_typeof(header.value))
                     FILTER (WHERE jsonb_typeof(header.value) IN ('object', 'array')))[1],
                array_agg(ARRAY[header.key, header.value #>> '{}'])
                    FILTER (WHERE jsonb_typeof(header.value) <> 'null'
                              AND lower(header.key) NOT IN ('message-id', 'created-at'))
               )::outbox_header_facts
     FROM jsonb_each(o.headers) AS header)
END

-- fragment: row_size
-- A row's size as %(max_bytes)s and %(message_max)s count it: payload, topic, key and
-- headers, each as the relay would hold it (an object's: its header_facts, `o.facts`;
-- other headers as stored). octet_length reads a stored length, never the bytes.
coalesce(octet_length(o.payload), 0) + coalesce(octet_length(o.topic), 0)
+ coalesce(octet_length(o.key), 0)
+ coalesce((o.facts).bytes, pg_column_size(o.headers), 0)

-- fragment: ready
-- Whether a row may be sent now: it is not waiting out a retry backoff, its key is not
-- in %(held)s (the relay holds a key back while an earlier row of it is in flight, say
-- in a sick partition), and no earlier row of its key is waiting: neither in a backoff
-- (or parked for a paused topic) nor scheduled and not yet let in, whether still in
-- the outbox (one probe of the tiny outbox_waiting_idx) or moved out into
-- outbox_scheduled (one probe of its key), nor held for a paused topic in
-- outbox_paused (one probe of its key). Each
-- per-row probe is asked only if the statement's one look there (an InitPlan, run once)
-- found any row at all: with nothing failing and nothing scheduled, as usual, a batch
-- costs no probe per row. (An own table's outbox_scheduled is an empty stand-in.)
(o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
AND (o.key IS NULL OR o.key <> ALL(%(held)s::text[]))
-- (Each look is the last entry of its index, ORDER BY ... DESC LIMIT 1: one descent
-- whatever the statistics say, where an EXISTS planned while thousands of rows were in
-- backoff, all sent since, read the whole outbox to find none; and the high end, past
-- the dead entries a vacuum has not yet cleared from the low end. Not max(), which
-- plans the same walk but costs a second planning of the subquery per look: two
-- looks in every fetch, each planned anew (custom plans). A row of no key blocks
-- nothing: the look skips it. The probe's first condition is the index's predicate,
-- word for word, so the planner can tell that the index holds every row it wants.)
AND ((SELECT waiting.key
      FROM outbox AS waiting
      WHERE (waiting.next_attempt_at IS NOT NULL
             OR (waiting.available_at IS NOT NULL AND waiting.promoted_at IS NULL))
        AND waiting.key IS NOT NULL
      ORDER BY waiting.key DESC
      LIMIT 1) IS NULL
     OR NOT EXISTS (
         SELECT 1
         FROM outbox AS blocker
         WHERE (blocker.next_attempt_at IS NOT NULL
                OR (blocker.available_at IS NOT NULL AND blocker.promoted_at IS NULL))
           AND blocker.key = o.key
           AND blocker.id < o.id
           AND (blocker.next_attempt_at > now()
                OR (blocker.available_at IS NOT NULL AND blocker.promoted_at IS NULL))
     ))
-- (Its look, by outbox_scheduled's index on available_at, is never a scan of the
-- table: after a large let-in the table is dead rows until a vacuum, and so is the low
-- end of the index; the rows let in were the soonest due.)
AND ((SELECT anything_parked.available_at
      FROM outbox_scheduled AS anything_parked
      ORDER BY anything_parked.available_at DESC
      LIMIT 1) IS NULL
     OR NOT EXISTS (
         SELECT 1
         FROM outbox_scheduled AS parked
         WHERE parked.key = o.key
           AND parked.id < o.id
     ))
-- Nor held out of the outbox for a paused topic (outbox_paused, by its index on (key,
-- id); an own table's is an empty stand-in). Its look is the last entry of the primary
-- key, the high end as above.
AND ((SELECT anything_held.id
      FROM outbox_paused AS anything_held
      ORDER BY anything_held.id DESC
      LIMIT 1) IS NULL
     OR NOT EXISTS (
         SELECT 1
         FROM outbox_paused AS held
         WHERE held.key = o.key
           AND held.id < o.id
     ))

-- fragment: unsendable
-- Why a fetched row cannot be sent as it is (it is dead-lettered with this reason): too
-- large to load, a topic no destination takes, a column an own table left NULL, or
-- headers that are no object of scalars. NULL: it can be sent.
CASE WHEN m.size > %(message_max)s::bigint THEN
         'the row holds ' || m.size || ' bytes of payload, topic, key and headers, over'
         || ' RELAY_MESSAGE_MAX_BYTES (' || %(message_max)s::bigint || ')'
     WHEN m.topic IS NULL THEN 'topic is NULL'
     WHEN octet_length(m.topic) > 1024 THEN
         'topic is ' || octet_length(m.topic) || ' bytes, over 1024 (no sink takes it)'
     WHEN m.message_id IS NULL THEN
         'message_id is NULL, or no id a header can carry (1-255 visible ASCII'
         || ' characters)'
     WHEN m.created_at IS NULL THEN 'created_at is NULL'
     WHEN m.headers IS NULL OR jsonb_typeof(m.headers) = 'null' THEN NULL
     WHEN jsonb_typeof(m.headers) = 'string' THEN
         'headers must be a JSON object, got string: ' || left(m.headers #>> '{}', 200)
     WHEN jsonb_typeof(m.headers) <> 'object' THEN
         'headers must be a JSON object, got ' || jsonb_typeof(m.headers)
     ELSE (m.facts).refused
END

-- fragment: message_times
-- created_at as text, made here in C (a row stamped 'infinity' says so: to_char has
-- nothing to print); due_epoch, when the row became due, for the latency histogram:
-- its available_at if it had a later one, else its created_at. date_part, not
-- extract: it makes the float8 directly (the same value), where extract's numeric
-- becomes one only through its text (about 0.3 µs a row, issue 36).
coalesce(CASE WHEN isfinite(m.created_at)
              THEN to_char(m.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
              ELSE m.created_at::text END, '')
    AS created_at,
coalesce(date_part('epoch', greatest(m.created_at, m.available_at)),
         date_part('epoch', now())) AS due_epoch

-- name: fetch_head
-- The fetch's common case, one cheap statement: the first %(limit)s unsent rows in id
-- order through the primary key, whatever they are, each with its size and whether it
-- is `ready`. No "id > last seen" cursor: a row that commits late with a lower id is
-- still found. `within`: the row fits %(max_bytes)s counting the ready rows before it
-- (the first ready row always does); rows past it come without their payload, so a
-- head of large rows never crosses the wire whole. When these rows need no sharing out
-- (the relay decides: see fetch_batch, step 2), the ready ones are the batch; otherwise
-- the relay runs fetch_batch. The projection is fetch_batch's (a test pins both to
-- OutboxMessage), the message id as text and the fragments above. With %(shards)s > 1,
-- only rows of shard %(shard)s; fetch_batch likewise. Scheduled rows
-- are left out until promote_due lets them in, and hold back the later rows of their
-- key meanwhile (`ready`).
SELECT m.id,
       coalesce(m.message_id::text, '') AS message_id,
       -- A row that cannot be sent for its size or its topic's carries a cut topic:
       -- enough for its dead-letter line, never its bytes.
       CASE WHEN m.size > %(message_max)s::bigint OR octet_length(m.topic) > 1024
            THEN left(m.topic, 200) ELSE coalesce(m.topic, '') END AS topic,
       m.key,
       CASE WHEN m.within AND m.size <= %(message_max)s::bigint THEN m.payload END AS payload,
       CASE WHEN m.within AND m.size <= %(message_max)s::bigint AND jsonb_typeof(m.headers) = 'object' THEN
           (m.facts).pairs
       END AS headers,
       {{unsendable}} AS unsendable,
       {{message_times}},
       m.attempts,
       m.ready,
       m.within
-- The running sums: a ROWS frame (ids are unique, so the same rows as the default
-- RANGE frame, without its look for peers) and a float8 sum (exact: a batch of rows
-- of at most RELAY_MESSAGE_MAX_BYTES each is far below 2^53), not sum(bigint)'s numeric.
FROM (SELECT head.*,
             head.ready
             AND (sum(CASE WHEN head.ready AND head.size <= %(message_max)s::bigint
                           THEN head.size::float8 ELSE 0 END)
                      OVER running <= %(max_bytes)s
                  OR count(*) FILTER (WHERE head.ready)
                      OVER running = 1) AS within
      FROM (SELECT o.*, {{row_size}} AS size
            FROM (SELECT o.*,
                         {{header_facts}} AS facts,
                         {{ready}} AS ready
                  FROM outbox AS o
                  WHERE {{drainable}}
                    -- The batches published and not yet settled.
                    AND {{not_in_flight}}
                    AND {{this_shard}}
                    -- RELAY_FAIRNESS=off walks on past a window it could not fill
                    -- (relay/store/fetch.py): from its last id. NULL: from the first.
                    AND (%(after)s::bigint IS NULL OR o.id > %(after)s::bigint)
                  ORDER BY o.id
                  LIMIT %(limit)s) AS o) AS head
      WINDOW running AS (ORDER BY head.id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS m
ORDER BY m.id;

-- name: one_snapshot
-- RELAY_FAIRNESS=off's walk past a window it could not fill (relay/store/fetch.py): every
-- window in one snapshot with one now(), so a row that may not go holds back its key's
-- later rows in every window alike. Read only: the walk writes nothing.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: fetch_batch
-- The fetch when the head needs sharing out (the relay runs fetch_head first): fair
-- across keys, bounded in rows and bytes, at a cost that does not grow with any key's
-- backlog (docs/DESIGN.md "Fetching: fair and bounded"). A CTE's body, unless short,
-- is the fragment of its name, below, which says why it is there. In steps:
-- 1. head: fetch_head's rows again (the first %(limit)s unsent rows in id order).
-- 2. crowded: the head is full and holds rows it may not send, or more ready rows of
--    one key than %(key_cap)s. Only then does the fetch look further (the relay runs
--    this statement when either holds, or when a key passes the cap in a head that is
--    not full, or, with fairness groups, when the head is full).
-- 3. keys: a round over the keys (by their hash) from just after %(after_key)s;
--    beyond: each key's next rows after the head, and the next rows without a key.
-- 4. groups (with %(grouped)s, RELAY_FAIRNESS_GROUP, and a full head): a round over
--    the groups from just after %(after_group)s; beyond_groups: each group's next rows
--    after the head, an equal share each.
-- 5. chosen: every key's first %(key_cap)s ready rows (the head's, then the round's keys
--    in its order), each group's first before any group's second when grouped, then
--    (if %(fill)s) further rows of busy keys, up to %(limit)s rows; kept: up to
--    %(max_bytes)s bytes.
-- Cost: at most %(limit)s head rows, plus, when crowded, %(limit)s key descents and
-- 2 x %(limit)s rows beyond the head; when grouped, %(limit)s group descents and
-- 2 x %(limit)s rows more. Rows come in id order, in fetch_head's projection plus
-- walked_to and walked_group: NULL but on a last row of their own, where the rounds over
-- keys and groups stopped.
WITH RECURSIVE head AS MATERIALIZED (
    {{head}}
),
head_keys AS (
    -- Ready rows per key in the head.
    SELECT h.key, count(*) AS n
    FROM head AS h
    WHERE h.ready AND h.key IS NOT NULL
    GROUP BY h.key
),
crowded AS (
    {{crowded}}
),
keys_after (key_hash) AS (
    {{keys_after}}
),
keys_before (key_hash) AS (
    {{keys_before}}
),
keys AS MATERIALIZED (
    {{keys}}
),
beyond AS (
    {{beyond}}
),
groups_after (grp) AS (
    {{groups_after}}
),
groups_before (grp) AS (
    {{groups_before}}
),
groups AS MATERIALIZED (
    {{groups}}
),
beyond_groups AS (
    {{beyond_groups}}
),
ranked AS (
    {{ranked}}
),
chosen AS (
    SELECT r.*
    FROM ranked AS r
    WHERE %(fill)s OR r.place <= %(key_cap)s
    ORDER BY r.place > %(key_cap)s, r.group_place, r.walk, r.id
    LIMIT %(limit)s
),
kept AS (
    {{kept}}
)
{{batch_projection}}
FROM kept AS m
UNION ALL
{{walked_to}}
ORDER BY id NULLS LAST;

------------------------------------------------------------------------------------
-- fetch_batch, part by part: the bodies of its CTEs in the statement's order, each
-- rule only they share before the first part that uses it.
------------------------------------------------------------------------------------

-- fragment: drainable
-- A row the drain may take: not scheduled for later, or let in by promote_due. Word
-- for word the predicate of outbox_key_hash_idx (and of the indexes `relay migrate
-- --shards` and `--fairness-group` build), so the planner can tell that it holds every
-- row the fetch wants. (An own table's view holds no row marked sent or dead-lettered.)
(o.available_at IS NULL OR o.promoted_at IS NOT NULL)

-- fragment: waiting
-- A row that holds back the later rows of its key: in a retry backoff, or scheduled
-- and not yet let in. Word for word the predicate of outbox_waiting_idx.
(o.next_attempt_at IS NOT NULL OR (o.available_at IS NOT NULL AND o.promoted_at IS NULL))

-- fragment: not_in_flight
-- Not in a batch published and not yet settled: `in_flight`, the ids of those with
-- gaps, and `in_flight_ranges`, the spans of those without (relay/store/fetch.py,
-- left_out_literals; a batch fetched in id order is one span). Both are sent untyped,
-- so the casts make them constants of the custom plan: the array a hash lookup, the
-- multirange a binary search. The planner prices the multirange in one step and the
-- array element by element: 0.2 ms of planning a fetch at 2,000 ids in flight.
o.id <> ALL(%(in_flight)s::bigint[])
AND NOT (o.id::bigint <@ %(in_flight_ranges)s::int8multirange)

-- fragment: candidate
-- A candidate row's columns, as every part of fetch_batch that reads rows hands them on
-- (head, beyond, beyond_groups): what the batch projection needs, what its size is
-- made of, whether it may be sent now (the size itself is ranked's: it reads the facts
-- made here).
o.id, o.message_id, o.topic, o.key, o.payload, o.headers, o.created_at,
o.available_at, o.attempts,
{{header_facts}} AS facts,
{{ready}} AS ready

-- fragment: head
-- Step 1: fetch_head's rows again, in one walk of the primary key, materialized: every
-- later step weighs itself against this same head (what is crowded in it, which keys
-- already have their share, which rows beyond it are new). walk: where a row stands
-- in the round over keys (chosen's order); the head's rows come before it.
SELECT {{candidate}},
       {{fairness_group}} AS grp,
       0::bigint AS walk
FROM outbox AS o
WHERE {{drainable}}
  -- The batches published and not yet settled.
  AND {{not_in_flight}}
  AND {{this_shard}}  -- this shard's rows only
ORDER BY o.id
LIMIT %(limit)s

-- fragment: crowded
-- Step 2: whether the fetch looks past the head at all (`yes`: the round over keys and
-- the rows without a key start only then), and what looking past it needs of the head.
SELECT count(*) = %(limit)s
       AND (bool_or(NOT h.ready)
            OR EXISTS (SELECT 1 FROM head_keys WHERE n > %(key_cap)s)) AS yes,
       -- Full of ready rows: a key with its share in the head gets nothing beyond
       -- it (those rows could never outrank a head row).
       count(*) = %(limit)s AND bool_and(h.ready) AS filled,
       -- Full: other groups may wait past it (the round over groups starts only then).
       count(*) = %(limit)s AS head_full,
       max(h.id) AS last_id
FROM head AS h

-- fragment: next_key
-- One step of the round over keys, from the key k it is at: the least key hash after
-- it with a row to drain, one descent of outbox_key_hash_idx however many rows
-- either key has (a DISTINCT over the keys would read every row of every key). The
-- round goes by the keys' hashes: the index then holds 8 bytes a
-- row, not the key, and the round needs no order of the keys themselves.
(SELECT min(outbox_key_hash(o.key))
 FROM outbox AS o
 WHERE {{drainable}}
   AND outbox_key_hash(o.key) > k.key_hash
   AND {{this_shard}})

-- fragment: keys_after
-- Step 3, the round over keys, first half: from just after %(after_key)s, where the
-- last round stopped (walked_to), to the last key, so the keys the last round had no
-- room for come first. A loose index scan: one descent per key (next_key).
SELECT s.key_hash
FROM (SELECT min(outbox_key_hash(o.key)) AS key_hash
      FROM outbox AS o
      WHERE {{drainable}}
        AND {{this_shard}}
        AND (%(after_key)s::bigint IS NULL
             OR outbox_key_hash(o.key) > %(after_key)s::bigint)) AS s
WHERE s.key_hash IS NOT NULL AND (SELECT yes FROM crowded)
UNION ALL
SELECT {{next_key}}
FROM keys_after AS k
WHERE k.key_hash IS NOT NULL

-- fragment: keys_before
-- The round's second half: from the first key up to %(after_key)s, wrapping around
-- once, so every key gets its turn wherever the round starts.
SELECT s.key_hash
FROM (SELECT min(outbox_key_hash(o.key)) AS key_hash
      FROM outbox AS o
      WHERE {{drainable}}
        AND {{this_shard}}) AS s
WHERE s.key_hash <= %(after_key)s::bigint AND (SELECT yes FROM crowded)
UNION ALL
SELECT {{next_key}}
FROM keys_before AS k
WHERE k.key_hash < %(after_key)s::bigint

-- fragment: keys
-- The round itself, in walk order: at most %(limit)s keys (so at most %(limit)s
-- descents, whatever the number of keys), leaving out keys that already have their
-- share in a head full of ready rows (crowded's `filled`).
SELECT u.key_hash, row_number() OVER () AS walk
FROM (SELECT key_hash FROM keys_after WHERE key_hash IS NOT NULL
      UNION ALL
      SELECT key_hash FROM keys_before WHERE key_hash <= %(after_key)s::bigint) AS u
WHERE NOT ((SELECT filled FROM crowded)
           AND EXISTS (SELECT 1 FROM head_keys AS hk
                       WHERE outbox_key_hash(hk.key) = u.key_hash
                         AND hk.n >= %(key_cap)s))
LIMIT %(limit)s

-- fragment: beyond
-- Step 3, the rows past the head that may take a head row's place: the next rows after
-- the head of each key in the round, an equal share of the batch each, so no key's
-- backlog buys it more; and the next rows without a key. Each row carries its key's
-- place in the round (walk), so that a batch too small for every key's share takes
-- the first keys of the round, and the next round starts after them (walked_to); a
-- row without a key is a key of its own, the n-th of them placed n-th.
SELECT p.*, k.walk
FROM keys AS k
CROSS JOIN LATERAL (
    SELECT {{candidate}},
           {{fairness_group}} AS grp
    FROM outbox AS o
    -- The key's rows after the head: "hash >= k AND hash <= k", ordered by (hash,
    -- id), and not "hash = k" ordered by id. With equality the planner may walk
    -- the outbox in id order and filter on the key (it did, when the
    -- statistics saw one key), reading a hot key's whole backlog to find a rare
    -- key's rows. This way only outbox_key_hash_idx yields the order without
    -- reading every candidate row first; "id > last head id" is checked in the index.
    WHERE outbox_key_hash(o.key) >= k.key_hash
      AND outbox_key_hash(o.key) <= k.key_hash
      AND o.id > (SELECT last_id FROM crowded)
      AND {{drainable}}
      AND {{not_in_flight}}
      AND {{this_shard}}  -- this shard's rows only, whatever shares their key's hash
    ORDER BY outbox_key_hash(o.key), o.id
    LIMIT (SELECT greatest(1, %(limit)s / count(*)) FROM keys)
) AS p
UNION ALL
(SELECT o.id, o.message_id, o.topic, o.key, o.payload, o.headers, o.created_at,
        o.available_at, o.attempts,
        {{header_facts}},
        -- `ready` for a row without a key: no key to hold back or wait behind.
        o.next_attempt_at IS NULL OR o.next_attempt_at <= now(),
        {{fairness_group}},
        row_number() OVER (ORDER BY outbox_key_hash(o.key), o.id)
 FROM outbox AS o
 WHERE (SELECT yes FROM crowded)
   AND outbox_key_hash(o.key) IS NULL
   AND o.id > (SELECT last_id FROM crowded)
   AND {{drainable}}
   AND {{not_in_flight}}
   AND {{this_shard}}
 ORDER BY outbox_key_hash(o.key), o.id  -- outbox_key_hash_idx's order: see above
 LIMIT %(limit)s)

-- fragment: fairness_group
-- A row's fairness group (RELAY_FAIRNESS_GROUP): %(group_kind)s 'key-prefix' or
-- 'header', %(group_arg)s the delimiter or the header's name. Under a
-- custom plan both are constants, so this is the expression of the index
-- `relay migrate --fairness-group` builds (outbox_fair_*). Without grouping, ''.
outbox_fairness_group(o.key, o.headers, %(group_kind)s::text, %(group_arg)s::text)

-- fragment: next_group
-- One step of the round over groups, from the group g it is at: the least group after
-- it with a row to drain, one descent of the grouping's index however many rows or keys
-- either group has.
(SELECT min({{fairness_group}})
 FROM outbox AS o
 WHERE {{drainable}}
   AND {{fairness_group}} > g.grp
   AND {{this_shard}})

-- fragment: groups_after
-- Step 4, the round over groups, as the round over keys: from just after
-- %(after_group)s to the last group, a descent per group (next_group); only when
-- grouped and the head is full (a head that is not full holds every row to drain).
SELECT s.grp
FROM (SELECT min({{fairness_group}}) AS grp
      FROM outbox AS o
      WHERE {{drainable}}
        AND {{this_shard}}
        AND (%(after_group)s::text IS NULL
             OR {{fairness_group}} > %(after_group)s::text)) AS s
WHERE s.grp IS NOT NULL AND %(grouped)s AND (SELECT head_full FROM crowded)
UNION ALL
SELECT {{next_group}}
FROM groups_after AS g
WHERE g.grp IS NOT NULL

-- fragment: groups_before
-- ... then from the first group up to %(after_group)s, wrapping around once.
SELECT s.grp
FROM (SELECT min({{fairness_group}}) AS grp
      FROM outbox AS o
      WHERE {{drainable}}
        AND {{this_shard}}) AS s
WHERE s.grp <= %(after_group)s::text AND %(grouped)s AND (SELECT head_full FROM crowded)
UNION ALL
SELECT {{next_group}}
FROM groups_before AS g
WHERE g.grp < %(after_group)s::text

-- fragment: groups
-- The round over groups in walk order: at most %(limit)s groups.
SELECT u.grp, row_number() OVER () AS walk
FROM (SELECT grp FROM groups_after WHERE grp IS NOT NULL
      UNION ALL
      SELECT grp FROM groups_before WHERE grp <= %(after_group)s::text) AS u
LIMIT %(limit)s

-- fragment: beyond_groups
-- Step 4, the rows past the head that may take a head row's place for their group: each
-- group's next rows after the head in id order, an equal share of the batch each, so no
-- group's backlog (in rows or in keys) buys it more. One walk of the grouping's index
-- per group, from the head's last id, as long as the share. With a header's groups, one
-- key's rows may be in several groups (an app that starts tagging them; a key that
-- changes tenant): a row of the share goes only if no earlier row of its key past the
-- head is in another group, whose share may not reach it, so each key's rows in the
-- pool stay a prefix of its rows (key-prefix groups are the key's own, and the test
-- folds away). The rows it leaves out still count in the share: a key whose rows
-- alternate groups costs a walk of one share, not of its backlog.
SELECT p.*, 0::bigint AS walk
FROM groups AS g
CROSS JOIN LATERAL (
    SELECT share.*
    FROM (SELECT {{candidate}},
                 g.grp
          FROM outbox AS o
          WHERE {{fairness_group}} = g.grp
            AND o.id > (SELECT last_id FROM crowded)
            AND {{drainable}}
            AND {{not_in_flight}}
            AND {{this_shard}}
          ORDER BY o.id
          LIMIT (SELECT greatest(1, %(limit)s / count(*)) FROM groups)) AS share
    WHERE %(group_kind)s::text <> 'header'
       OR share.key IS NULL
       OR NOT EXISTS (
           SELECT 1
           FROM outbox AS earlier
           WHERE outbox_key_hash(earlier.key) = outbox_key_hash(share.key)
             AND earlier.key = share.key
             AND earlier.id > (SELECT last_id FROM crowded)
             AND earlier.id < share.id
             AND (earlier.available_at IS NULL OR earlier.promoted_at IS NOT NULL)
             AND earlier.id <> ALL(%(in_flight)s::bigint[])
             AND NOT (earlier.id::bigint <@ %(in_flight_ranges)s::int8multirange)
             AND outbox_fairness_group(earlier.key, earlier.headers, %(group_kind)s::text,
                                       %(group_arg)s::text) <> share.grp)
) AS p

-- fragment: ranked
-- Step 5's order, over the ready rows of head, beyond and beyond_groups together (a
-- row both beyonds found counted once), so that chosen can take every key's first rows
-- before any key's further ones: that is the fairness. place: 1 for a key's first
-- ready row, 2 for its second, ...; rows without a key have no order to keep and are
-- each their own first. group_place, when grouped: 1 for a group's first row in
-- chosen's order, 2 for its second, ...: chosen goes round the groups. A key counts in
-- the group of its first row in the pool (with a header's groups its rows may carry
-- several), so all its rows are numbered in one group, in id order; whatever prefix of
-- this order is chosen, each key keeps a prefix of its rows.
SELECT placed.*,
       CASE WHEN %(grouped)s
            THEN row_number() OVER (PARTITION BY placed.key_group COLLATE "C"
                                    ORDER BY placed.place > %(key_cap)s, placed.id)
            ELSE 0
       END AS group_place
FROM (SELECT pool.*,
             CASE WHEN pool.key IS NULL THEN 1
                  ELSE row_number() OVER (PARTITION BY pool.key COLLATE "C" ORDER BY pool.id)
             END AS place,
             CASE WHEN pool.key IS NULL THEN pool.grp
                  ELSE first_value(pool.grp) OVER (PARTITION BY pool.key COLLATE "C"
                                                   ORDER BY pool.id)
             END AS key_group
      FROM (SELECT o.*, {{row_size}} AS size
            FROM (SELECT * FROM head WHERE ready
                  UNION ALL
                  SELECT * FROM beyond WHERE ready
                  UNION ALL
                  SELECT * FROM beyond_groups AS g
                  WHERE g.ready AND NOT EXISTS (SELECT 1 FROM beyond AS b WHERE b.id = g.id)
                 ) AS o) AS pool) AS placed

-- fragment: kept
-- Step 5's byte bound, cut in (group_place, place, walk, id) order: every group's first row
-- before any group's second, every key's first before any key's second, so one group's
-- or key's large rows cannot take the whole budget; each key still keeps a prefix of
-- its rows, so per-key order holds. The first row goes even if larger.
SELECT w.*
FROM (SELECT c.*,
             sum(c.carried) OVER (ORDER BY c.group_place, c.place, c.walk, c.id) AS bytes
      FROM (SELECT chosen.*,
                   CASE WHEN chosen.size > %(message_max)s::bigint THEN 0
                        ELSE chosen.size END AS carried
            FROM chosen) AS c) AS w
WHERE w.bytes <= %(max_bytes)s OR w.bytes = w.carried

-- fragment: batch_projection
-- The batch in fetch_head's projection (a test pins both to OutboxMessage), so the
-- relay reads either fetch's rows alike; every row here is ready and within the byte
-- budget.
SELECT m.id,
       coalesce(m.message_id::text, '') AS message_id,
       -- A row that cannot be sent for its size or its topic's carries a cut topic:
       -- enough for its dead-letter line, never its bytes.
       CASE WHEN m.size > %(message_max)s::bigint OR octet_length(m.topic) > 1024
            THEN left(m.topic, 200) ELSE coalesce(m.topic, '') END AS topic,
       m.key,
       CASE WHEN m.size <= %(message_max)s::bigint THEN m.payload END AS payload,
       CASE WHEN m.size <= %(message_max)s::bigint AND jsonb_typeof(m.headers) = 'object' THEN
           (m.facts).pairs
       END AS headers,
       {{unsendable}} AS unsendable,
       {{message_times}},
       m.attempts,
       true AS ready,
       true AS within,
       NULL::bigint AS walked_to,
       NULL::text AS walked_group

-- fragment: walked_to
-- Last, a row of its own: where the next fetch's round over keys starts (%(after_key)s):
-- when the round reached as many keys as it may, or had no room for some key's ready
-- rows, after the last key of this round that got rows, so keys it reached but had no
-- room for come first next time (a full round where none got rows, all held back:
-- after the whole round; a shorter one: where it started); otherwise NULL, from the
-- start, since this round went all the way round and served every key. The same for
-- the round over groups (%(after_group)s).
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       CASE WHEN (SELECT count(*) FROM keys) = %(limit)s
                 OR EXISTS (SELECT 1 FROM ranked AS r
                            WHERE r.key IS NOT NULL AND r.walk > 0
                              AND NOT EXISTS (SELECT 1 FROM kept AS c WHERE c.key = r.key))
            THEN coalesce((SELECT k.key_hash
                           FROM keys AS k
                           WHERE EXISTS (SELECT 1 FROM kept AS c
                                         WHERE outbox_key_hash(c.key) = k.key_hash)
                           ORDER BY k.walk DESC
                           LIMIT 1),
                          CASE WHEN (SELECT count(*) FROM keys) = %(limit)s
                               THEN (SELECT k.key_hash FROM keys AS k
                                     ORDER BY k.walk DESC LIMIT 1)
                               ELSE %(after_key)s::bigint
                          END)
       END,
       CASE WHEN (SELECT count(*) FROM groups) = %(limit)s
            THEN coalesce((SELECT g.grp
                           FROM groups AS g
                           WHERE EXISTS (SELECT 1 FROM kept AS c WHERE c.grp = g.grp)
                           ORDER BY g.walk DESC
                           LIMIT 1),
                          (SELECT g.grp FROM groups AS g ORDER BY g.walk DESC LIMIT 1))
       END

-- name: schedule_moves
-- Scheduled delivery's moves, before promote_due, for the relay's own
-- outbox: up to %(limit)s due rows of outbox_scheduled let back into the outbox, of this
-- shard, then up to %(limit)s rows scheduled for later moved out into it (none once
-- outbox_unpark_all switched parking off). Each a function that runs as the tables'
-- owner; neither needs a fence: a row let in or set aside is right whoever moves it.
-- `more`: the let-in stopped at its bounds with due rows left.
SELECT back.let_in, back.more, outbox_park_scheduled(%(limit)s) AS parked
FROM outbox_let_in(%(limit)s, %(shards)s, %(shard)s) AS back;

-- name: promote_due
-- Scheduled delivery: let up to %(limit)s scheduled rows still in the
-- outbox whose available_at has passed (database clock) into the drain, soonest due
-- first, by setting promoted_at: from then on they are ordinary unsent rows, in their
-- id's place (schedule_moves lets in those moved out).
-- A walk of the tiny outbox_waiting_idx finds them, or that there are none. Rows another
-- session has locked wait for the next pass. Needs no fence: letting a due row in is
-- right whoever does it, and a deposed leader's promotion only saves the next one the
-- work. With shards, this shard's rows only. Also returns in how many seconds the next
-- scheduled row is due (NULL: none), so the loop knows when to look again: of any shard,
-- one probe (filtering on this shard would walk every other shard's schedule, a cost
-- that grows with it), in the outbox and in outbox_scheduled; at worst a cheap pass that
-- finds nothing. The wait is a difference of epochs: a row scheduled at 'infinity' is
-- never due, and fails nothing.
WITH due AS (
    SELECT o.id
    FROM outbox AS o
    WHERE {{waiting}}
      AND o.available_at IS NOT NULL
      AND o.promoted_at IS NULL
      AND o.available_at <= now()
      AND {{this_shard}}
    ORDER BY o.available_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
promoted AS (
    UPDATE outbox AS o
    SET promoted_at = now()
    FROM due
    WHERE o.id = due.id
    RETURNING o.id
)
SELECT (SELECT count(*) FROM promoted) AS promoted,
       least((SELECT (extract(epoch FROM o.available_at) - extract(epoch FROM now()))::float8
                FROM outbox AS o
               WHERE {{waiting}}
                 AND o.available_at IS NOT NULL
                 AND o.promoted_at IS NULL
                 AND o.available_at > now()
               ORDER BY o.available_at
               LIMIT 1),
             (SELECT (extract(epoch FROM s.available_at) - extract(epoch FROM now()))::float8
                FROM outbox_scheduled AS s
               WHERE s.available_at > now()
               ORDER BY s.available_at
               LIMIT 1)) AS next_due_in_seconds;

------------------------------------------------------------------------------------
-- Settling
------------------------------------------------------------------------------------

-- fragment: fence
-- The settles' fence: lease_renew (lease.sql) word for word (a test holds them to it).
-- It matches no row once a newer holder took the lease, and then the settle writes
-- nothing.
UPDATE leases
SET expires_at = now() + make_interval(secs => %(ttl)s),
    renewed_at = now(),
    updated_at = now()
WHERE name = %(name)s
  AND holder = %(holder)s
  AND epoch = %(epoch)s
  AND released_at IS NULL
RETURNING epoch, clock_timestamp() AS at

-- name: settle_delete_sent
-- The usual settle, every row of the batch acknowledged: lease_renew then delete_sent,
-- as ONE statement: one round trip, no transaction left open between them. The rows
-- are touched only if the fence held (the EXISTS runs the fence first, once); no row
-- back means a newer holder exists and nothing was written. (Two statements, not one
-- with a switch: a DELETE anywhere in it would need the DELETE privilege in retention
-- mode too.)
WITH fence AS (
    {{fence}}
),
settled AS (
    DELETE FROM outbox
    WHERE id = ANY(%(ids)s::bigint[])
      AND EXISTS (SELECT FROM fence)
)
SELECT epoch, at FROM fence;

-- name: settle_mark_sent
-- settle_delete_sent for an own table's retention mode: lease_renew then mark_sent, as
-- one statement.
WITH fence AS (
    {{fence}}
),
settled AS (
    UPDATE outbox
    SET sent_at = now(),
        next_attempt_at = NULL
    WHERE id = ANY(%(ids)s::bigint[])
      AND sent_at IS NULL
      AND EXISTS (SELECT FROM fence)
)
SELECT epoch, at FROM fence;

-- name: settle_move_sent
-- settle_delete_sent for retention mode: lease_renew, then the rows
-- moved into the current generation of outbox_sent, as one statement. The outbox keeps
-- no sent row, so its indexes and the fetch never meet one; keeping a row costs one
-- insert into a table without indexes, and the purge empties generations whole.
WITH fence AS (
    {{fence}}
),
gone AS (
    DELETE FROM outbox
    WHERE id = ANY(%(ids)s::bigint[])
      AND EXISTS (SELECT FROM fence)
    RETURNING *
),
kept AS (
    {{keep_gone}}
)
SELECT epoch, at FROM fence;

-- name: move_sent
-- settle_move_sent's move, in a settle transaction that took the fence already.
WITH gone AS (
    DELETE FROM outbox
    WHERE id = ANY(%(ids)s::bigint[])
    RETURNING *
)
{{keep_gone}};

-- fragment: keep_gone
-- The rows just deleted (`gone`), into outbox_sent's current generation: the one that
-- began last (four rows to look at).
INSERT INTO outbox_sent (generation, id, message_id, topic, key, payload, headers,
                         created_at, available_at, attempts, last_error, sent_at)
SELECT (SELECT g.generation FROM outbox_sent_generations AS g
        ORDER BY g.started_at DESC LIMIT 1),
       gone.id, gone.message_id, gone.topic, gone.key, gone.payload, gone.headers,
       gone.created_at, gone.available_at, gone.attempts, gone.last_error, now()
FROM gone

-- name: mark_sent
-- Acknowledged rows of an own table, kept for RELAY_RETENTION_SECONDS (retention mode).
UPDATE outbox
SET sent_at = now(),
    next_attempt_at = NULL
WHERE id = ANY(%(ids)s::bigint[])
  AND sent_at IS NULL;

-- name: delete_sent
-- Acknowledged rows, deleted at once (default: no history to bloat).
DELETE FROM outbox
WHERE id = ANY(%(ids)s::bigint[]);

-- name: record_failures
-- Transient failures: count the attempt and schedule the next one. A row the sink sent
-- back unsent, or refused for its destination as a whole (a rate limit, a Retry-After
-- pause), spends none (`attempted` 0).
UPDATE outbox AS o
SET attempts        = o.attempts + f.attempted,
    next_attempt_at = now() + make_interval(secs => f.delay),
    last_error      = f.error
FROM unnest(%(ids)s::bigint[], %(attempted)s::int[], %(delays)s::float8[], %(errors)s::text[])
     AS f (id, attempted, delay, error)
WHERE o.id = f.id;

-- name: dead_letter_move
-- Permanent failures and rows out of attempts: out of the drain, moved into outbox_dead
-- with the reason, under their ids, in the settle's transaction (the function
-- outbox_dead_letter, which runs as its owner: the runtime role inserts no row anywhere
-- but through it). Only the rows of up to 16 MiB of payload and headers: copying
-- hundreds of MB could outlast the settle's statement timeout, and the settle would fail
-- again and again; dead_letter_move_rest moves the others after it. How many it moved.
SELECT outbox_dead_letter(coalesce(array_agg(f.id), '{}'),
                          coalesce(array_agg(f.attempted), '{}'),
                          coalesce(array_agg(f.reason), '{}')) AS moved
FROM unnest(%(ids)s::bigint[], %(attempted)s::int[], %(reasons)s::text[])
     AS f (id, attempted, reason)
JOIN outbox AS o ON o.id = f.id
WHERE coalesce(octet_length(o.payload), 0) + coalesce(pg_column_size(o.headers), 0)
      <= 16777216;

-- name: dead_letter_move_rest
-- After a settle whose dead_letter_move left rows (over 16 MiB), in a transaction of
-- their own that took the fence again (lease_renew) and lifted the statement timeout
-- (no_statement_timeout): those rows into outbox_dead. Until then they are in flight,
-- so no fetch takes them; after a crash in between, they are sent again.
SELECT outbox_dead_letter(%(ids)s::bigint[], %(attempted)s::int[], %(reasons)s::text[])
    AS moved;

-- name: no_statement_timeout
SET LOCAL statement_timeout = 0;

-- name: dead_letter
-- Dead letters marked where they are, with the reason, out of the drain: an own table's
-- (RELAY_OUTBOX_TABLE), whose view then holds them no more.
UPDATE outbox AS o
SET attempts           = o.attempts + f.attempted,
    dead_lettered_at   = now(),
    dead_letter_reason = f.reason,
    last_error         = f.reason,
    next_attempt_at    = NULL
FROM unnest(%(ids)s::bigint[], %(attempted)s::int[], %(reasons)s::text[]) AS f (id, attempted, reason)
WHERE o.id = f.id;

------------------------------------------------------------------------------------
-- Paused topics (`relay pause`, outbox_paused_topics in migrations/0100_schema.sql)
------------------------------------------------------------------------------------

-- name: paused_topics
-- The topics paused now, read by every drain at least once a second.
SELECT p.topic FROM outbox_paused_topics AS p;

-- name: pause_lock
-- In a settle that parks rows, before park_paused: the pause lock of each of their
-- topics, shared (outbox_resume takes it exclusively). Its own statement, so that
-- park_paused, the next one, reads the pauses as they are once the locks are held.
SELECT count(pg_advisory_xact_lock_shared('outbox_paused_topics'::regclass::oid::integer,
                                          hashtext(t.topic)))
FROM (SELECT DISTINCT unnest(%(topics)s::text[]) AS topic ORDER BY 1) AS t;

-- name: hold_paused
-- The rows of paused topics %(topics)s among the first %(walk)s the drain may take from
-- id %(from_id)s on, moved out into outbox_paused (the function, migrations/
-- 0100_schema.sql, runs as the tables' owner); the rows in flight and other shards' are
-- left where they are. How many moved. Needs no fence: a row held is right whoever
-- holds it.
SELECT outbox_hold_paused(%(topics)s::text[], %(from_id)s::bigint, %(walk)s::integer,
                          %(in_flight)s::bigint[], %(in_flight_ranges)s::int8multirange,
                          %(shards)s::integer, %(shard)s::integer) AS held;

-- name: release_paused
-- Up to %(limit)s held rows of topics resumed back into the outbox, by id; `more`: rows
-- of a resumed topic are left, for the next pass at once.
SELECT r.released, r.more FROM outbox_release_paused(%(limit)s::integer) AS r;

-- name: park_paused
-- The rows of a paused topic the drain fetched and could not hold in outbox_paused (an
-- own table's, or a row too large to move), parked where they are: in the waiting
-- index, due never, so the fetch holds the later rows of their keys behind them. No
-- attempt is spent and last_error is left as it was. A row whose topic was resumed
-- meanwhile is left as it is, and sent by a later fetch.
UPDATE outbox AS o
SET next_attempt_at = 'infinity'
WHERE o.id = ANY(%(ids)s::bigint[])
  AND EXISTS (SELECT 1 FROM outbox_paused_topics AS p WHERE p.topic = o.topic);

-- name: unpark_resumed
-- The rows parked for a pause that is over, let go: a walk of the small
-- outbox_waiting_idx. Any replica may run it, the first to see a topic resumed does.
UPDATE outbox AS o
SET next_attempt_at = NULL
WHERE {{waiting}}
  AND o.next_attempt_at = 'infinity'
  AND NOT EXISTS (SELECT 1 FROM outbox_paused_topics AS p WHERE p.topic = o.topic);
