-- Fairness per tenant (RELAY_FAIRNESS_GROUP): the group of a row, as one function.
--
-- A group is what the operator calls a tenant: the key up to the first delimiter
-- (`key-prefix`, e.g. `tenant-42` of `tenant-42:order-7`; a key without the delimiter
-- is its own group) or the value of one header (`header`). A row with neither (no key,
-- no such header, headers that are no object) is in the group ''. Nothing is stored in
-- the outbox and apps change nothing: the fetch walks the groups through an expression
-- index on this function, created for one grouping by
-- `relay migrate --fairness-group SPEC` (see the README's "Fairness per tenant").
-- IMMUTABLE and a plain SQL body: the planner inlines it and folds `kind` away, so the
-- fetch's expression, with the grouping's constants, is the index's expression.
CREATE FUNCTION outbox_fairness_group(key text, headers jsonb, kind text, arg text)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN coalesce(CASE kind
                        WHEN 'key-prefix' THEN split_part(key, arg, 1)
                        WHEN 'header' THEN CASE WHEN jsonb_typeof(headers) = 'object'
                                                THEN headers ->> arg END
                    END, '');

COMMENT ON FUNCTION outbox_fairness_group(text, jsonb, text, text) IS
    'The fairness group (tenant) of an outbox row: a key prefix or a header''s value; '''' for none.';
