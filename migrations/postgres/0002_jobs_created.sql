-- Every tenant's jobs, newest first (the admin's listing, `GET
-- /v1/admin/jobs`, which the dashboard polls), without a scan and sort of
-- the whole table; also serves the purge of old jobs by `created_at`.
CREATE INDEX jobs_created ON jobs (created_at DESC, id DESC);
