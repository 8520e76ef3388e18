-- The console's audit names every row a change touched, not only the first and last.
--
-- A discard deletes rows for good, and a discard by search records the search, which
-- matches other rows (or none) afterwards: without the ids, which rows went could not
-- be told. `row_ids` holds every outbox id the requeue or discard changed, in id order
-- (as many as row_count); the console writes it with the entry, in the change's
-- transaction. Entries recorded before this migration keep NULL.
--
-- A nullable column without a default: console_audit is scanned once for the check
-- (every existing entry passes with NULL), never rewritten; the outbox is not touched. Table grants cover the new column
-- (console_grants.sql is unchanged). Run `relay migrate` before starting a console of
-- this release: it writes the column.
ALTER TABLE console_audit
    ADD COLUMN IF NOT EXISTS row_ids bigint[]
        CHECK (row_ids IS NULL OR cardinality(row_ids) = row_count);

COMMENT ON COLUMN console_audit.row_ids IS
    'Every outbox id the change requeued or discarded, in id order (NULL: recorded before migration 0014).';
