-- Jobs, their attempts and the certification history (SQLite).
-- Times are milliseconds since the Unix epoch; ids and JSON are TEXT;
-- flags are INTEGER 0/1. Keep in step with migrations/postgres.

CREATE TABLE jobs (
    id              TEXT    NOT NULL PRIMARY KEY,
    tenant          TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    payload_hash    TEXT    NOT NULL,
    fingerprint     TEXT    NOT NULL,
    route           TEXT    NOT NULL,
    request         TEXT    NOT NULL,
    metadata        TEXT,
    state           TEXT    NOT NULL
        CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    version         BIGINT  NOT NULL DEFAULT 0,
    completed_by    INTEGER,
    result          TEXT,
    error           TEXT,
    not_before      BIGINT  NOT NULL,
    claimed_by      TEXT,
    claim_until     BIGINT,
    created_at      BIGINT  NOT NULL,
    updated_at      BIGINT  NOT NULL,
    -- The identity rule: creation races are settled by this constraint.
    UNIQUE (tenant, idempotency_key)
);

-- A tenant's listing, newest first, with (created_at, id) as the cursor.
CREATE INDEX jobs_tenant_created ON jobs (tenant, created_at DESC, id DESC);
-- Claiming queued jobs that are due; also the claim reconciler (running).
CREATE INDEX jobs_state_not_before ON jobs (state, not_before);

CREATE TABLE attempts (
    job_id       TEXT    NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    n            INTEGER NOT NULL,
    provider     TEXT    NOT NULL,
    model        TEXT    NOT NULL,
    state        TEXT    NOT NULL
        CHECK (state IN ('starting', 'running', 'succeeded', 'failed', 'unknown', 'cancelled', 'discarded')),
    reason       TEXT,
    hedge        INTEGER NOT NULL DEFAULT 0 CHECK (hedge IN (0, 1)),
    read_version BIGINT  NOT NULL,
    owner        TEXT,
    started_at   BIGINT  NOT NULL,
    finished_at  BIGINT,
    lease_until  BIGINT,
    PRIMARY KEY (job_id, n)
);

-- The reconciler looks attempts up by state (expired leases, unknown ones).
CREATE INDEX attempts_state ON attempts (state, lease_until);

-- Every certification run is kept; readers take the latest per target.
CREATE TABLE certifications (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    route         TEXT    NOT NULL,
    provider      TEXT    NOT NULL,
    model         TEXT    NOT NULL,
    contract_hash TEXT    NOT NULL,
    passed        INTEGER NOT NULL CHECK (passed IN (0, 1)),
    failures      TEXT    NOT NULL,
    certified_at  BIGINT  NOT NULL
);

CREATE INDEX certifications_latest
    ON certifications (route, provider, model, certified_at DESC, id DESC);
