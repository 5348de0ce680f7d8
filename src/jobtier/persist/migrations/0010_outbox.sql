-- 0010: the transactional outbox (docs/outbox.md). An application calls
-- `SELECT jobtier.submit(type, payload, ...)` inside its own transaction: the job is an outbox
-- row that commits or rolls back with the application's writes. The relay in the persister
-- (persist/outbox.py) submits committed rows into Redis, each under its job id and an
-- idempotency key, so that a relay that dies after its Redis submit and before marking the
-- row submits the same job again, which Redis answers with the job it already has.

CREATE SCHEMA IF NOT EXISTS jobtier;

-- For a role named jobtier the new schema is "$user", the first entry of the default
-- search_path: unqualified names (schema_migrations, the next migrations' tables, new history
-- partitions) would land in it. That role's sessions get a search_path without it, from now
-- on (the role's own setting: any role may set its own) and in this transaction. Left alone
-- where jobtier's tables were made in a schema `jobtier` on purpose (jobtier.jobs exists).
DO $$
DECLARE
    path text;
BEGIN
    SELECT coalesce(string_agg(quote_ident(s), ', ' ORDER BY n), 'public') INTO path
    FROM unnest(current_schemas(false)) WITH ORDINALITY AS t(s, n)
    WHERE s <> 'jobtier';
    IF 'jobtier' = ANY (current_schemas(false)) AND to_regclass('jobtier.jobs') IS NULL THEN
        EXECUTE format('ALTER ROLE %I SET search_path = %s', current_user, path);
        PERFORM set_config('search_path', path, true);
    END IF;
END
$$;

-- The deployment's shard count, which a job id names (<ULID>-<shard>), and the API's limits
-- jobtier.submit checks (JOBTIER_MAX_PAYLOAD_BYTES, JOBTIER_MAX_FLOW_JOBS): written by every
-- relay when it starts, as only the processes know them.
CREATE TABLE jobtier.outbox_config (
    one               boolean NOT NULL DEFAULT true,
    shards            integer NOT NULL,
    max_payload_bytes integer NOT NULL,
    max_depends_on    integer NOT NULL,
    CONSTRAINT outbox_config_pkey PRIMARY KEY (one),
    CONSTRAINT outbox_config_one CHECK (one),
    CONSTRAINT outbox_config_shards CHECK (shards BETWEEN 1 AND 10000),
    CONSTRAINT outbox_config_limits CHECK (max_payload_bytes > 0 AND max_depends_on > 0)
);

-- One row per job submitted through jobtier.submit. `relayed_at` is set when the relay has
-- decided it: submitted into Redis (error NULL), or refused (error: why; the job is failed).
-- Relayed rows are kept for the idempotency TTL, refused ones for the job retention: the
-- idempotency keys of jobs submitted here are checked here (persist/outbox.py: prune).
CREATE TABLE jobtier.outbox (
    seq             bigserial   NOT NULL,  -- relay order: ids made in one millisecond are not
    id              text        NOT NULL,
    tenant          text        NOT NULL,
    type            text        NOT NULL,
    payload         json        NOT NULL,
    queue           text,
    priority        text        NOT NULL,
    run_at          timestamptz,  -- a delay is made a run-at when the row is written
    idempotency_key text,
    max_attempts    integer,
    depends_on      text[],
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    relayed_at      timestamptz,
    error           text,
    CONSTRAINT outbox_pkey PRIMARY KEY (id)
);

CREATE UNIQUE INDEX outbox_idempotency_idx ON jobtier.outbox (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- what the relay reads: the rows not yet relayed, in the order they were written
CREATE INDEX outbox_pending_idx ON jobtier.outbox (seq) WHERE relayed_at IS NULL;
CREATE INDEX outbox_relayed_idx ON jobtier.outbox (relayed_at) WHERE relayed_at IS NOT NULL;

-- A job id as keys.py makes one: a ULID (48-bit millisecond time, 80 random bits, Crockford
-- base32), '-', a random shard. The random bits come from two version-4 UUIDs, leaving out
-- byte 6 of the first, whose low bits hold the version.
CREATE FUNCTION jobtier.new_job_id(shards integer) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    digits constant text := '0123456789ABCDEFGHJKMNPQRSTVWXYZ';
    ms bigint := (extract(epoch FROM clock_timestamp()) * 1000)::bigint & 281474976710655;
    r bytea := uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid());
    picks constant int[] := ARRAY[0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
    out text := '';
    i int;
BEGIN
    FOR i IN REVERSE 9..0 LOOP
        out := out || substr(digits, ((ms >> (i * 5)) & 31)::int + 1, 1);
    END LOOP;
    FOREACH i IN ARRAY picks LOOP
        out := out || substr(digits, (get_byte(r, i) & 31) + 1, 1);
    END LOOP;
    RETURN out || '-' || (((get_byte(r, 17) << 8) | get_byte(r, 18)) % shards)::text;
END
$$;

-- jobtier.submit: the options of POST /v1/jobs. What SQL can check is checked here (the
-- error names the argument, and the caller's transaction fails with it), the sizes against
-- the limits the relay recorded; what needs the task catalogue (an unknown type, a payload
-- its schema refuses) is checked by the relay, which then marks the job failed with the
-- reason.
CREATE FUNCTION jobtier.submit(
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

-- jobtier.submit for callers that can insert into a table but not call a function: an
-- application whose own database reaches this one through postgres_fdw, which imports tables
-- and views, never functions (docs/outbox.md). An INSERT into this view is a jobtier.submit
-- call; RETURNING id gives the job's id. Reading it shows nothing (it is not a listing).
CREATE VIEW jobtier.submissions AS
SELECT NULL::text AS id, NULL::text AS type, NULL::json AS payload, NULL::text AS queue,
       NULL::text AS priority, NULL::double precision AS delay, NULL::timestamptz AS run_at,
       NULL::text AS idempotency_key, NULL::integer AS max_attempts, NULL::text[] AS depends_on,
       NULL::text AS tenant
WHERE false;

CREATE FUNCTION jobtier.submissions_insert() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.id := jobtier.submit(NEW.type, coalesce(NEW.payload, 'null'), NEW.queue,
                             coalesce(NEW.priority, 'normal'), NEW.delay, NEW.run_at,
                             NEW.idempotency_key, NEW.max_attempts, NEW.depends_on, NEW.tenant);
    RETURN NEW;
END
$$;

CREATE TRIGGER submissions_insert INSTEAD OF INSERT ON jobtier.submissions
    FOR EACH ROW EXECUTE FUNCTION jobtier.submissions_insert();

-- Executing it is granted role by role (docs/outbox.md): it writes as its owner, so a role
-- allowed to call it needs no right on the outbox table itself.
REVOKE ALL ON FUNCTION jobtier.submit(text, json, text, text, double precision, timestamptz,
                                      text, integer, text[], text) FROM PUBLIC;
REVOKE ALL ON FUNCTION jobtier.new_job_id(integer) FROM PUBLIC;
