-- 0022: jobtier.submit refuses in the caller's statement what the relay would only refuse
-- later, its job failed after the caller's transaction had committed: a run_at of
-- 'infinity', or further ahead than the API allows (JOBTIER_MAX_FUTURE_SECONDS); max_attempts
-- over the API's bound; a depends_on id of a shard the deployment does not have. The API
-- refuses each in its request (a 422); here, the statement fails (invalid_parameter_value,
-- naming its column) and nothing is written. A trigger on the outbox checks them, whichever
-- way a row comes (jobtier.submit, the submissions view), so jobtier.submit's body (0021)
-- stays as it is. The bounds are the relay's settings, recorded as the shard count is (its
-- start, persist/outbox.sql outbox_record_config); until a relay of this version has
-- started, only the infinity is refused. Rows already in the outbox are not checked: the
-- relay refuses those, each alone, as before.
ALTER TABLE jobtier.outbox_config
    ADD COLUMN max_future_seconds double precision,
    ADD COLUMN max_attempts integer;

CREATE FUNCTION jobtier.outbox_check() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    shards integer;
    ahead double precision;
    attempts integer;
    dep text;
BEGIN
    SELECT c.shards, c.max_future_seconds, c.max_attempts INTO shards, ahead, attempts
    FROM jobtier.outbox_config c;
    IF NEW.run_at = 'infinity'::timestamptz THEN  -- (-infinity is long past: due at once)
        RAISE EXCEPTION 'jobtier.submit: run_at is infinity, not a time a job can have'
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'run_at';
    END IF;
    IF ahead IS NOT NULL AND NEW.run_at > clock_timestamp() + make_interval(secs => ahead) THEN
        RAISE EXCEPTION 'jobtier.submit: run_at % is further ahead than % s (% days, '
            'JOBTIER_MAX_FUTURE_SECONDS)', NEW.run_at, ahead, round((ahead / 86400)::numeric)
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'run_at';
    END IF;
    IF attempts IS NOT NULL AND NEW.max_attempts > attempts THEN
        RAISE EXCEPTION 'jobtier.submit: max_attempts must be between 1 and %', attempts
            USING ERRCODE = 'invalid_parameter_value', COLUMN = 'max_attempts';
    END IF;
    FOREACH dep IN ARRAY coalesce(NEW.depends_on, '{}') LOOP
        IF split_part(dep, '-', 2)::integer >= shards THEN
            RAISE EXCEPTION 'jobtier.submit: depends_on holds %, a job of shard %: this '
                'deployment has % shards (0 to %), so no such job exists',
                quote_literal(dep), split_part(dep, '-', 2), shards, shards - 1
                USING ERRCODE = 'invalid_parameter_value', COLUMN = 'depends_on';
        END IF;
    END LOOP;
    RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION jobtier.outbox_check() FROM PUBLIC;

CREATE TRIGGER outbox_check BEFORE INSERT ON jobtier.outbox
    FOR EACH ROW EXECUTE FUNCTION jobtier.outbox_check();
