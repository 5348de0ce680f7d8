-- The dispatchers ask now and then whether a tenant still has a job's callback (to unmark the
-- tenants that have no webhook target left: webhooks/marks.py): by tenant, not by job.
CREATE INDEX webhook_job_callbacks_tenant_idx ON webhook_job_callbacks (tenant);
