-- Webhooks: subscriptions, job callbacks, signing secrets and deliveries.
-- Used by the API (api/webhooks.py) and the dispatcher (webhooks/deliveries.py).

-- name: secret_get
SELECT secret, previous, previous_until FROM webhook_secrets WHERE tenant = $1

-- name: secret_rotate
-- Create the tenant's secret, or replace it: the old one keeps signing (beside the new one)
-- until previous_until, so receivers can switch over without missing a delivery.
INSERT INTO webhook_secrets AS w (tenant, secret)
VALUES ($1, $2)
ON CONFLICT (tenant) DO UPDATE SET
    previous = w.secret,
    previous_until = now() + make_interval(secs => $3),
    secret = excluded.secret,
    created_at = now()
RETURNING created_at, previous_until

-- name: secret_create_if_missing
INSERT INTO webhook_secrets (tenant, secret) VALUES ($1, $2)
ON CONFLICT (tenant) DO NOTHING
RETURNING created_at

-- name: secrets_for
-- The secrets in force for these tenants (the previous one while its overlap lasts).
SELECT tenant, secret, CASE WHEN previous_until > now() THEN previous END AS previous
FROM webhook_secrets WHERE tenant = ANY($1::text[])

-- name: subscription_insert
INSERT INTO webhook_subscriptions (id, tenant, url, events, description)
VALUES ($1, $2, $3, $4, $5)
RETURNING id, url, events, description, created_at, disabled_at

-- name: subscription_get
SELECT id, url, events, description, created_at, disabled_at
FROM webhook_subscriptions WHERE id = $1 AND tenant = $2

-- name: subscription_list
-- A tenant's subscriptions, oldest first, keyset-paginated by id (ids sort by creation).
SELECT id, url, events, description, created_at, disabled_at
FROM webhook_subscriptions WHERE tenant = $1 AND id > $2
ORDER BY id LIMIT $3

-- name: subscription_delete
-- Its waiting deliveries are cancelled with it (their records stay, with the job's).
WITH gone AS (
    DELETE FROM webhook_subscriptions WHERE id = $1 AND tenant = $2 RETURNING id
), cancelled AS (
    UPDATE webhook_deliveries SET state = 'cancelled', finished_at = now(), lease = NULL,
        next_attempt_at = NULL, last_error = 'subscription deleted'
    WHERE subscription_id IN (SELECT id FROM gone) AND state = 'pending'
)
SELECT count(*) FROM gone

-- name: subscription_disable
-- The receiver answered 410 Gone: send it nothing more.
WITH off AS (
    UPDATE webhook_subscriptions SET disabled_at = now()
    WHERE id = $1 AND disabled_at IS NULL RETURNING id
)
UPDATE webhook_deliveries SET state = 'cancelled', finished_at = now(), lease = NULL,
    next_attempt_at = NULL, last_error = 'the receiver answered 410 Gone'
WHERE subscription_id IN (SELECT id FROM off) AND state = 'pending'

-- name: callbacks_insert
-- A job's own callbacks, before its submit reaches Redis (see api/webhooks.py).
INSERT INTO webhook_job_callbacks (job_id, tenant, url, events)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])
ON CONFLICT (job_id) DO NOTHING

-- name: callbacks_delete
-- Callbacks of ids a submit did not create (an idempotent duplicate answered another job).
DELETE FROM webhook_job_callbacks WHERE job_id = ANY($1::text[])

-- name: targets_subscriptions
-- The live subscriptions of the tenants in a batch of log entries.
SELECT id, tenant, url, events, created_at FROM webhook_subscriptions
WHERE tenant = ANY($1::text[]) AND disabled_at IS NULL

-- name: targets_callbacks
SELECT job_id, tenant, url, events FROM webhook_job_callbacks WHERE job_id = ANY($1::text[])

-- name: targets_tenants
-- Every tenant that may have a target: marked in Redis at a dispatcher's start-up.
SELECT tenant FROM webhook_subscriptions WHERE disabled_at IS NULL
UNION
SELECT DISTINCT tenant FROM webhook_job_callbacks

-- name: targets_tenants_among
-- Which of these tenants still have a target (a live subscription or a job's callback): the
-- others' marks may go (webhooks/marks.py). One index probe per tenant and table.
SELECT t.tenant FROM unnest($1::text[]) AS t(tenant)
WHERE EXISTS (
    SELECT 1 FROM webhook_subscriptions s WHERE s.tenant = t.tenant AND s.disabled_at IS NULL
) OR EXISTS (SELECT 1 FROM webhook_job_callbacks c WHERE c.tenant = t.tenant)

-- name: deliveries_insert
-- New deliveries, due at once (the dispatcher that made them leases them next, as any
-- dispatcher may); a log entry read again after a crash makes the same ids, which are skipped.
-- Returns the ids inserted.
INSERT INTO webhook_deliveries
    (id, tenant, job_id, job_version, subscription_id, url, event, body, occurred_at,
     next_attempt_at)
SELECT d.id, d.tenant, d.job_id, d.job_version, d.subscription_id, d.url, d.event, d.body,
       d.occurred_at, now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::text[], $7::text[],
            $8::bytea[], $9::timestamptz[])
    AS d(id, tenant, job_id, job_version, subscription_id, url, event, body, occurred_at)
ORDER BY d.id
ON CONFLICT (id) DO NOTHING
RETURNING id

-- name: deliveries_lease_due
-- Take up to $1 due deliveries for an attempt: each is leased (its next_attempt_at moved past
-- the attempt's longest duration) under a new token; SKIP LOCKED lets dispatchers share.
UPDATE webhook_deliveries AS d
SET next_attempt_at = now() + make_interval(secs => $2), lease = $3
FROM (
    SELECT id FROM webhook_deliveries
    WHERE state = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
) AS due
WHERE d.id = due.id
RETURNING d.id, d.tenant, d.job_id, d.subscription_id, d.url, d.body, d.attempts,
          d.occurred_at

-- name: deliveries_by_id
SELECT id, tenant, job_id, subscription_id, url, body, attempts, occurred_at
FROM webhook_deliveries WHERE id = ANY($1::text[])

-- name: deliveries_record
-- The outcomes of attempts, recorded only by the holder of each delivery's lease (a
-- dispatcher whose lease ran out, and whose delivery another one took, records nothing).
WITH o AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::real[],
                         $6::int[], $7::text[], $8::text[], $9::timestamptz[])
        AS o(id, lease, state, at, duration_ms, status, error, response, next_attempt_at)
), done AS (
    UPDATE webhook_deliveries AS d
    SET state = o.state, attempts = d.attempts + 1, last_status = o.status,
        last_error = o.error, next_attempt_at = o.next_attempt_at,
        lease = NULL, finished_at = CASE WHEN o.state = 'pending' THEN NULL ELSE o.at END
    FROM o
    WHERE d.id = o.id AND d.lease = o.lease
    RETURNING d.id, d.attempts
)
INSERT INTO webhook_attempts (delivery_id, attempt, at, duration_ms, status, error, response)
SELECT o.id, done.attempts, o.at, o.duration_ms, o.status, o.error, o.response
FROM o JOIN done ON done.id = o.id
ON CONFLICT (delivery_id, attempt) DO NOTHING
RETURNING delivery_id

-- name: deliveries_pending_count
SELECT count(*) AS pending, min(next_attempt_at) AS next_due
FROM webhook_deliveries WHERE state = 'pending'

-- name: deliveries_of_job
SELECT id, job_id, job_version, subscription_id, url, event, state, attempts, created_at,
       occurred_at, next_attempt_at, last_status, last_error, finished_at
FROM webhook_deliveries WHERE job_id = $1 AND tenant = $2
ORDER BY created_at, id LIMIT $3

-- name: deliveries_of_subscription
SELECT id, job_id, job_version, subscription_id, url, event, state, attempts, created_at,
       occurred_at, next_attempt_at, last_status, last_error, finished_at
FROM webhook_deliveries WHERE subscription_id = $1 AND tenant = $2
ORDER BY created_at DESC, id DESC LIMIT $3

-- name: attempts_of
SELECT delivery_id, attempt, at, duration_ms, status, error, response
FROM webhook_attempts WHERE delivery_id = ANY($1::text[])
ORDER BY delivery_id, attempt

-- name: result_blob_put
-- A worker's large result (JOBTIER_RESULT_STORE=postgres), one row per attempt.
INSERT INTO result_blobs (job_id, token, data) VALUES ($1, $2, $3)
ON CONFLICT (job_id, token) DO UPDATE SET data = excluded.data

-- name: result_blob_get
SELECT data FROM result_blobs WHERE job_id = $1 AND token = $2

-- name: result_blob_size
SELECT octet_length(data) AS size FROM result_blobs WHERE job_id = $1 AND token = $2

-- name: result_blob_chunk
-- One slice of a blob (1-based offset), so a large result streams without being held whole.
SELECT substring(data FROM $3 FOR $4) AS chunk FROM result_blobs WHERE job_id = $1 AND token = $2
