-- An idempotency key names one job whichever way it is submitted (docs/outbox.md, Limits).
-- The API keeps a key's record in Redis in the shard it derives from the tenant and the key
-- (core/keys.py shard_for: crc32 of "<tenant>\0<key>", modulo the shard count), the relay's
-- submit in its job's shard, which jobtier.submit picked at random: the relay found a key an
-- HTTP submit had used one time in the shard count, and an HTTP submit never found a key the
-- outbox had used. A job submitted with a key now has its id in the key's shard.

-- CRC-32 (IEEE 802.3, reflected; zlib's crc32), of bytes.
CREATE FUNCTION jobtier.crc32(data bytea) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    crc bigint := 4294967295;
    i integer;
    j integer;
BEGIN
    FOR i IN 0 .. length(data) - 1 LOOP
        crc := crc # get_byte(data, i);
        FOR j IN 1 .. 8 LOOP
            crc := (crc >> 1) # (3988292384 * (crc & 1));  -- 0xEDB88320
        END LOOP;
    END LOOP;
    RETURN crc # 4294967295;
END
$$;

-- The shard of an idempotency key's record, as keys.py shard_for(tenant, key) computes it.
CREATE FUNCTION jobtier.key_shard(tenant text, key text, shards integer) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
    SELECT (jobtier.crc32(convert_to(tenant, 'UTF8') || decode('00', 'hex') || convert_to(key, 'UTF8'))
            % shards)::integer
$$;

REVOKE ALL ON FUNCTION jobtier.crc32(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION jobtier.key_shard(text, text, integer) FROM PUBLIC;

CREATE OR REPLACE FUNCTION jobtier.submit(
    type            text,
    payload         json        DEFAULT 'null',
    queue           text        DEFAULT NULL,
    priority        text        DEFAULT 'normal',
    delay           double precision DEFAULT NULL,
    run_at          timestamptz DEFAULT NULL,
    idempotency_key text        DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL,
    depends_on      text[]      DEFAULT NULL,
    tenant          text        DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- a bare name is the column (ON CONFLICT's); the arguments are always written submit.<name>
#variable_conflict use_column
DECLARE
    who text := coalesce(submit.tenant, nullif(current_setting('jobtier.tenant', true), ''),
                         'default');
    pinned text := nullif(current_setting('jobtier.tenant', true), '');
    n integer;
    max_payload integer;
    max_deps integer;
    job text;
    earlier record;
    dep text;
BEGIN
    SELECT c.shards, c.max_payload_bytes, c.max_depends_on INTO n, max_payload, max_deps
    FROM jobtier.outbox_config c;
    IF n IS NULL THEN
        RAISE EXCEPTION 'jobtier.submit: no relay has started on this database yet, so the '
            'deployment''s shard count is unknown'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'start a persister (its outbox relay records it), then submit';
    END IF;
    -- bounded before anything else reads them: the relay would hold them in memory
    IF octet_length(coalesce(submit.payload::text, 'null')) > max_payload THEN
        RAISE EXCEPTION 'jobtier.submit: payload is % bytes as written; the limit is % '
            '(JOBTIER_MAX_PAYLOAD_BYTES)', octet_length(submit.payload::text), max_payload
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'payload';
    END IF;
    IF cardinality(submit.depends_on) > max_deps THEN
        RAISE EXCEPTION 'jobtier.submit: depends_on names % jobs; the limit is % '
            '(JOBTIER_MAX_FLOW_JOBS)', cardinality(submit.depends_on), max_deps
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'depends_on';
    END IF;
    IF submit.type IS NULL OR submit.type !~ '^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$' THEN
        RAISE EXCEPTION 'jobtier.submit: type % is not a task name', quote_nullable(submit.type)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'type';
    END IF;
    IF pinned IS NOT NULL AND who <> pinned THEN
        RAISE EXCEPTION 'jobtier.submit: tenant % is not this session''s (jobtier.tenant = %)',
            quote_literal(who), quote_literal(pinned)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'tenant';
    END IF;
    IF who !~ '^[A-Za-z0-9_.-]{1,64}$' THEN
        RAISE EXCEPTION 'jobtier.submit: tenant % is not a tenant name', quote_literal(who)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'tenant';
    END IF;
    IF submit.queue IS NOT NULL AND submit.queue !~ '^[A-Za-z0-9_.-]{1,64}$' THEN
        RAISE EXCEPTION 'jobtier.submit: queue % is not a queue name', quote_literal(submit.queue)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'queue';
    END IF;
    IF submit.priority IS NULL OR submit.priority NOT IN ('critical', 'high', 'normal', 'low') THEN
        RAISE EXCEPTION 'jobtier.submit: priority % is not one of critical, high, normal, low',
            quote_nullable(submit.priority)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'priority';
    END IF;
    IF submit.delay IS NOT NULL AND submit.run_at IS NOT NULL THEN
        RAISE EXCEPTION 'jobtier.submit: give run_at or delay, not both'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'run_at';
    END IF;
    IF submit.delay IS NOT NULL AND NOT (submit.delay >= 0 AND submit.delay < 'Infinity') THEN
        RAISE EXCEPTION 'jobtier.submit: delay must be a non-negative number of seconds'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'delay';
    END IF;
    IF submit.idempotency_key IS NOT NULL AND submit.idempotency_key !~ '^[!-~]{1,200}$' THEN
        RAISE EXCEPTION 'jobtier.submit: idempotency_key must be 1 to 200 printable ASCII '
            'characters without spaces'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'idempotency_key';
    END IF;
    IF submit.max_attempts IS NOT NULL AND submit.max_attempts < 1 THEN
        RAISE EXCEPTION 'jobtier.submit: max_attempts must be at least 1'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_attempts';
    END IF;
    FOREACH dep IN ARRAY coalesce(submit.depends_on, '{}') LOOP
        IF dep IS NULL OR dep !~ '^[0-9A-HJKMNP-TV-Z]{26}-(0|[1-9][0-9]{0,3})$' THEN
            RAISE EXCEPTION 'jobtier.submit: depends_on holds %, not a job id', quote_nullable(dep)
                USING ERRCODE = 'invalid_parameter_value', COLUMN = 'depends_on';
        END IF;
    END LOOP;

    LOOP
        IF submit.idempotency_key IS NOT NULL THEN
            SELECT o.id, o.type, o.payload::text AS payload INTO earlier
            FROM jobtier.outbox o
            WHERE o.tenant = who AND o.idempotency_key = submit.idempotency_key;
            IF FOUND THEN
                IF earlier.type = submit.type AND earlier.payload = coalesce(submit.payload::text, 'null') THEN
                    RETURN earlier.id;
                END IF;
                RAISE EXCEPTION 'jobtier.submit: idempotency_key % already names job % of '
                    'another type or payload', quote_literal(submit.idempotency_key), earlier.id
                    USING ERRCODE = 'unique_violation', COLUMN = 'idempotency_key';
            END IF;
        END IF;
        job := jobtier.new_job_id(n);
        IF submit.idempotency_key IS NOT NULL THEN
            -- in the shard of the key, where the API keeps a key's record (keys.py
            -- shard_for): a key is then one job whichever way it was submitted
            job := split_part(job, '-', 1) || '-' || jobtier.key_shard(who, submit.idempotency_key, n);
        END IF;
        INSERT INTO jobtier.outbox AS o (id, tenant, type, payload, queue, priority, run_at,
                                         idempotency_key, max_attempts, depends_on)
        VALUES (job, who, submit.type, coalesce(submit.payload, 'null'), submit.queue,
                submit.priority,
                coalesce(submit.run_at,
                         clock_timestamp() + make_interval(secs => submit.delay)),
                submit.idempotency_key, submit.max_attempts, submit.depends_on)
        ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;
        IF FOUND THEN
            -- delivered at commit, once per transaction however many jobs it submitted; a
            -- session with jobtier.notify = off leaves the relay to find the row by polling
            -- (Postgres serialises the commits of notifying transactions: docs/outbox.md)
            IF coalesce(current_setting('jobtier.notify', true), '') <> 'off' THEN
                PERFORM pg_notify('jobtier_outbox', '');
            END IF;
            RETURN job;
        END IF;
        -- another transaction committed this key meanwhile: answer with its job
    END LOOP;
END
$$;

