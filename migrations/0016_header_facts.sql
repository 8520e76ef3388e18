-- What the fetch reads from a row's headers, in one walk of them (relay/sql/drain.sql,
-- fragment header_facts): their size, why they cannot be sent if so, and the pairs to
-- send. A named type, so that one scalar subquery hands all three on, and a row
-- without headers skips it (a lateral join would run, and cost, for every row).
-- Nothing is stored: it only types a value of the fetch.
DO $$
BEGIN
    CREATE TYPE outbox_header_facts AS (
        bytes   bigint,  -- names and values, as row_size counts them
        refused text,    -- why the first header whose value is an object or array cannot go
        pairs   text[]   -- [name, value] pairs to send
    );
EXCEPTION WHEN duplicate_object THEN
    NULL;  -- a DBA created it first, as written here
END
$$;
