-- Virtual keys and budgets kept in the database, shared by every replica
-- (PostgreSQL). Times are milliseconds since the Unix epoch; money is
-- nano-dollars (1 dollar = 1e9). Keep in step with migrations/sqlite.

-- A tenant's API keys. The secret itself is never stored: `digest` is the
-- hex SHA-256 of it, `hint` what a listing shows. `models` is a JSON array
-- of route names (null: every route), `metadata` a JSON object. Every
-- change of a key adds 1 to `version` (its last use does not), so that
-- replicas notice changes by polling `COUNT(*)` and `SUM(version)`.
CREATE TABLE api_keys (
    id            TEXT    NOT NULL PRIMARY KEY,
    tenant        TEXT    NOT NULL,
    name          TEXT    NOT NULL,
    digest        TEXT    NOT NULL UNIQUE,
    hint          TEXT    NOT NULL,
    expires_at    BIGINT,
    models        TEXT,
    rpm           BIGINT,
    tpm           BIGINT,
    budget_nanos  BIGINT,
    budget_period TEXT
        CHECK (budget_period IN ('1d', '7d', '30d')),
    metadata      TEXT,
    created_at    BIGINT  NOT NULL,
    revoked_at    BIGINT,
    rotated_at    BIGINT,
    last_used_at  BIGINT,
    version       BIGINT  NOT NULL DEFAULT 1
);

CREATE INDEX api_keys_tenant_created ON api_keys (tenant, created_at);

-- One row per spender (`key:<id>` or `tenant:<name>`): its limit (null:
-- none, spend still counted), its period (null: never resets), what it
-- spent in the current period and in all.
CREATE TABLE budgets (
    scope        TEXT    NOT NULL PRIMARY KEY,
    limit_nanos  BIGINT,
    period_ms    BIGINT,
    period_start BIGINT  NOT NULL,
    spent_nanos  BIGINT  NOT NULL DEFAULT 0,
    total_nanos  BIGINT  NOT NULL DEFAULT 0,
    calls        BIGINT  NOT NULL DEFAULT 0
);

-- What each gateway process (`holder`) has reserved of a budget and not
-- yet settled, under a lease: a dead holder's reservations lapse.
CREATE TABLE budget_grants (
    scope        TEXT    NOT NULL,
    holder       TEXT    NOT NULL,
    amount_nanos BIGINT  NOT NULL,
    lease_until  BIGINT  NOT NULL,
    PRIMARY KEY (scope, holder)
);

-- A holder renews all its grants at once; the reconciler removes lapsed ones.
CREATE INDEX budget_grants_holder ON budget_grants (holder);
CREATE INDEX budget_grants_lease ON budget_grants (lease_until);

-- Who changed which key, when, and how (`detail`: a JSON object).
CREATE TABLE key_audit (
    id     BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     BIGINT  NOT NULL,
    actor  TEXT    NOT NULL,
    action TEXT    NOT NULL
        CHECK (action IN ('create', 'update', 'revoke', 'rotate')),
    key_id TEXT    NOT NULL,
    tenant TEXT    NOT NULL,
    detail TEXT    NOT NULL
);

CREATE INDEX key_audit_key_at ON key_audit (key_id, at);
-- The log of every key, newest first.
CREATE INDEX key_audit_at ON key_audit (at);

-- The store's key a job was created with (null: a key of the
-- configuration file): its attempts' calls are charged to that key's
-- budget as the request's would have been.
ALTER TABLE jobs ADD COLUMN key_id TEXT;
