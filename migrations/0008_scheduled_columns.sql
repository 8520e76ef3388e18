-- Scheduled delivery: a row is not published before its available_at (database clock).
--
-- available_at is the app's column: NULL (the default) means now. A row written with
-- one is "scheduled": it stays out of the drain's indexes (0009) until the leader finds
-- it due and sets promoted_at (relay bookkeeping, like sent_at), so a large schedule
-- costs the fetch nothing, and a scheduled row is not lag until it is due. Until then it
-- holds back the later rows of its key, as a row waiting out a retry backoff does
-- (per-key order: README "Scheduled delivery"). The app's available_at is never changed.
--
-- Two nullable columns without a default: no rewrite, the lock is held for an instant.
-- It is the lock the ALTER must wait for behind the app's transactions, and the app's
-- statements queue behind the waiting ALTER: give up after a few seconds rather than
-- stall the app (`relay migrate` fails; run it again).
SET LOCAL lock_timeout = '5s';

ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS available_at timestamptz,
    ADD COLUMN IF NOT EXISTS promoted_at  timestamptz;

COMMENT ON COLUMN outbox.available_at IS
    'Not published before this time (database clock); NULL means now. Written by the app.';
COMMENT ON COLUMN outbox.promoted_at IS
    'When the relay found this scheduled row due and let it into the drain (bookkeeping).';
