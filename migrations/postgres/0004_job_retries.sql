-- The attempts a job may make are counted over its whole life, not per run
-- of a worker: `retries` is how many manual retries (`POST
-- /v1/jobs/{id}/attempts`) were granted, each one attempt beyond the
-- route's `attempts.max`.
ALTER TABLE jobs ADD COLUMN retries INTEGER NOT NULL DEFAULT 0;
