-- Files of the Batch API (SQLite): what a tenant uploaded, and later the
-- files batches write. Times are milliseconds since the Unix epoch. Keep in
-- step with migrations/postgres.

-- A file is written in parts, then made visible: `status` is `uploading`
-- until its last part is in (such a row is neither listed nor read, and an
-- upload that never finished is swept), then `processed`. `lines` counts
-- its newline-terminated lines (a last line without one counts too).
CREATE TABLE files (
    id          TEXT    NOT NULL PRIMARY KEY,
    tenant      TEXT    NOT NULL,
    purpose     TEXT    NOT NULL,
    filename    TEXT    NOT NULL,
    bytes       BIGINT  NOT NULL DEFAULT 0,
    lines       BIGINT  NOT NULL DEFAULT 0,
    status      TEXT    NOT NULL
        CHECK (status IN ('uploading', 'processed')),
    created_at  BIGINT  NOT NULL,
    expires_at  BIGINT
);
CREATE INDEX files_by_tenant ON files (tenant, created_at, id);

-- A file's content in parts of at most 1 MiB, numbered from 0, so that
-- neither an upload nor a download holds a whole file in memory.
CREATE TABLE file_parts (
    file_id  TEXT    NOT NULL REFERENCES files (id) ON DELETE CASCADE,
    n        INTEGER NOT NULL,
    data     BLOB    NOT NULL,
    PRIMARY KEY (file_id, n)
);
