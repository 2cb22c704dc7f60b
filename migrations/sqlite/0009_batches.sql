-- Batches of the Batch API (SQLite). Times are milliseconds since the Unix
-- epoch. Keep in step with migrations/postgres.

-- A batch: a tenant's input file run line by line, each line a job (keyed
-- by the batch and its custom_id). At most one replica drives a batch at a
-- time (`claimed_by` until `claim_until`); a driver that died leaves a
-- claim that lapses, and the next one resumes from the jobs already made.
CREATE TABLE batches (
    id                TEXT    NOT NULL PRIMARY KEY,
    tenant            TEXT    NOT NULL,
    -- A batch created again with the same key is the same batch.
    idempotency_key   TEXT,
    payload_hash      TEXT    NOT NULL,
    endpoint          TEXT    NOT NULL,
    input_file_id     TEXT    NOT NULL,
    completion_window TEXT    NOT NULL,
    metadata          TEXT,
    key_id            TEXT,
    status            TEXT    NOT NULL
        CHECK (status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed',
                          'expired', 'cancelling', 'cancelled')),
    -- JSON: the errors that failed the batch in validation.
    errors            TEXT,
    output_file_id    TEXT,
    error_file_id     TEXT,
    total             BIGINT  NOT NULL DEFAULT 0,
    completed         BIGINT  NOT NULL DEFAULT 0,
    failed            BIGINT  NOT NULL DEFAULT 0,
    -- Lines answered without a call of their own: the same as an earlier
    -- line of the batch, or as a line of an earlier batch.
    deduplicated      BIGINT  NOT NULL DEFAULT 0,
    reused            BIGINT  NOT NULL DEFAULT 0,
    -- Lines not run because the batch was cancelled or expired first
    -- (among the failed).
    not_run           BIGINT  NOT NULL DEFAULT 0,
    created_at        BIGINT  NOT NULL,
    expires_at        BIGINT  NOT NULL,
    in_progress_at    BIGINT,
    finalizing_at     BIGINT,
    completed_at      BIGINT,
    failed_at         BIGINT,
    expired_at        BIGINT,
    cancelling_at     BIGINT,
    cancelled_at      BIGINT,
    claimed_by        TEXT,
    claim_until       BIGINT,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX batches_by_tenant ON batches (tenant, created_at, id);
CREATE INDEX batches_active ON batches (status, claim_until);

-- A line's job names its batch; an earlier batch's answer to the same
-- request (same tenant and fingerprint) is found by the index.
ALTER TABLE jobs ADD COLUMN batch_id TEXT;
CREATE INDEX jobs_batch_fingerprint ON jobs (tenant, fingerprint, created_at)
    WHERE batch_id IS NOT NULL;
