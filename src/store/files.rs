//! Files of the Batch API in the store: a row per file and its content in
//! numbered parts of at most [`PART_BYTES`], so that an upload is written
//! and a download read one part at a time, never whole in memory.
//!
//! A file becomes visible only when its last part is in: [`FileStore::begin_file`]
//! writes the row as `uploading` (neither listed nor read), the parts
//! follow, and [`FileStore::finish_file`] makes it `processed`. An upload
//! that never finished (its client went away, its process died) is swept
//! with its parts by [`FileStore::sweep_files`], as are expired files.
//! With `batches.files_dir` (SQLite) the parts are files in that directory
//! ([`super::parts`]) and the rows stay in the database.

use async_trait::async_trait;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};

use super::Result;
use super::sql::Dialect;

/// The most a part holds.
pub const PART_BYTES: usize = 1 << 20;

/// How long an upload that never finished keeps its row and parts before
/// the reconciler sweeps them (an upload must arrive within
/// `server.body_timeout` anyway).
pub const ABANDONED_UPLOAD_MS: i64 = 3_600_000;

/// A file (a `files` row that is `processed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRecord {
    /// `file-<uuid v7, hex>`, chosen by the caller.
    pub id: String,
    pub tenant: String,
    /// `batch` for an uploaded input, `batch_output` for what a batch
    /// wrote.
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    /// Its lines (a last line without a newline counts).
    pub lines: i64,
    pub created_at: i64,
    /// None: kept until deleted.
    pub expires_at: Option<i64>,
}

from_row!(FileRecord {
    id,
    tenant,
    purpose,
    filename,
    bytes,
    lines,
    created_at,
    expires_at
});

/// Where a listing of files starts and which way it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Oldest first.
    Ascending,
    /// Newest first.
    Descending,
}

/// The store's files (see the module documentation).
#[async_trait]
pub trait FileStore: Send + Sync + 'static {
    /// Starts a file: its row, `uploading`, with `bytes` and `lines` 0.
    async fn begin_file(&self, file: &FileRecord) -> Result<()>;

    /// Part `n` (from 0) of a file being written.
    async fn put_file_part(&self, id: &str, n: i32, data: &[u8]) -> Result<()>;

    /// The file written: its purpose and expiry (a form may give them
    /// after the content), size and lines (`file`'s), and from now on
    /// visible. False if its row is gone (swept).
    async fn finish_file(&self, file: &FileRecord) -> Result<bool>;

    /// A tenant's file, if it exists and is finished.
    async fn file(&self, tenant: &str, id: &str) -> Result<Option<FileRecord>>;

    /// A tenant's finished files, optionally of one purpose, in `order`
    /// of creation, strictly after the file `after` (none if that file is
    /// not the tenant's).
    async fn list_files(
        &self,
        tenant: &str,
        purpose: Option<&str>,
        after: Option<&str>,
        order: Order,
        limit: u32,
    ) -> Result<Vec<FileRecord>>;

    /// Part `n` of a file (none past its last part).
    async fn file_part(&self, id: &str, n: i32) -> Result<Option<Vec<u8>>>;

    /// Deletes a tenant's file and its parts; false if it had none of
    /// that id.
    async fn delete_file(&self, tenant: &str, id: &str) -> Result<bool>;

    /// Deletes uploads begun before `begun_before` and never finished, and
    /// files that expired before `now`, with their parts: how many.
    async fn sweep_files(&self, begun_before: i64, now: i64) -> Result<u64>;
}

type Row<D> = <<D as Dialect>::Db as Database>::Row;

/// The columns of a [`FileRecord`], for `concat!`.
macro_rules! columns {
    () => {
        "id, tenant, purpose, filename, bytes, lines, created_at, expires_at"
    };
}

#[async_trait]
impl<D> FileStore for D
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<&'q str>: Encode<'q, D::Db>,
    for<'q> &'q [u8]: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
    for<'q> i32: Encode<'q, D::Db> + Type<D::Db>,
    for<'r> FileRecord: FromRow<'r, Row<D>>,
    for<'r> (Vec<u8>,): FromRow<'r, Row<D>>,
    for<'r> (i64, String): FromRow<'r, Row<D>>,
    for<'r> (String,): FromRow<'r, Row<D>>,
{
    async fn begin_file(&self, file: &FileRecord) -> Result<()> {
        sqlx::query(
            "INSERT INTO files (id, tenant, purpose, filename, bytes, lines, status, created_at,
                                expires_at)
             VALUES ($1, $2, $3, $4, 0, 0, 'uploading', $5, $6)",
        )
        .bind(file.id.as_str())
        .bind(file.tenant.as_str())
        .bind(file.purpose.as_str())
        .bind(file.filename.as_str())
        .bind(file.created_at)
        .bind(file.expires_at)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    async fn put_file_part(&self, id: &str, n: i32, data: &[u8]) -> Result<()> {
        if let Some(dir) = self.parts() {
            return dir.put(id, n, data).await;
        }
        sqlx::query("INSERT INTO file_parts (file_id, n, data) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(n)
            .bind(data)
            .execute(self.writer())
            .await?;
        Ok(())
    }

    async fn finish_file(&self, file: &FileRecord) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE files SET status = 'processed', purpose = $2, bytes = $3, lines = $4,
                              expires_at = $5
             WHERE id = $1 AND status = 'uploading'",
        )
        .bind(file.id.as_str())
        .bind(file.purpose.as_str())
        .bind(file.bytes)
        .bind(file.lines)
        .bind(file.expires_at)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) > 0)
    }

    async fn file(&self, tenant: &str, id: &str) -> Result<Option<FileRecord>> {
        Ok(sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM files WHERE id = $1 AND tenant = $2 AND status = 'processed'"
        ))
        .bind(id)
        .bind(tenant)
        .fetch_optional(self.reader())
        .await?)
    }

    async fn list_files(
        &self,
        tenant: &str,
        purpose: Option<&str>,
        after: Option<&str>,
        order: Order,
        limit: u32,
    ) -> Result<Vec<FileRecord>> {
        // The cursor is the file `after`'s place in the order: (created_at,
        // id), both compared, so files made in the same millisecond are
        // neither skipped nor repeated.
        let start = match after {
            Some(id) => {
                let at: Option<(i64, String)> = sqlx::query_as(
                    "SELECT created_at, id FROM files WHERE id = $1 AND tenant = $2",
                )
                .bind(id)
                .bind(tenant)
                .fetch_optional(self.reader())
                .await?;
                match at {
                    Some(at) => Some(at),
                    None => return Ok(Vec::new()),
                }
            }
            None => None,
        };
        // Two texts, each prepared once: the comparison and the order
        // follow the direction.
        let sql = match order {
            Order::Ascending => concat!(
                "SELECT ",
                columns!(),
                " FROM files
                 WHERE tenant = $1 AND status = 'processed'
                   AND (CAST($2 AS TEXT) IS NULL OR purpose = $2)
                   AND (CAST($3 AS BIGINT) IS NULL OR (created_at, id) > ($3, $4))
                 ORDER BY created_at ASC, id ASC
                 LIMIT $5"
            ),
            Order::Descending => concat!(
                "SELECT ",
                columns!(),
                " FROM files
                 WHERE tenant = $1 AND status = 'processed'
                   AND (CAST($2 AS TEXT) IS NULL OR purpose = $2)
                   AND (CAST($3 AS BIGINT) IS NULL OR (created_at, id) < ($3, $4))
                 ORDER BY created_at DESC, id DESC
                 LIMIT $5"
            ),
        };
        let (at, id) = start.map_or((None, None), |(at, id)| (Some(at), Some(id)));
        Ok(sqlx::query_as(sql)
            .bind(tenant)
            .bind(purpose)
            .bind(at)
            .bind(id.as_deref())
            .bind(i64::from(limit))
            .fetch_all(self.reader())
            .await?)
    }

    async fn file_part(&self, id: &str, n: i32) -> Result<Option<Vec<u8>>> {
        // A file written before `batches.files_dir` was set has its parts
        // in the database: read there when the directory has none.
        if let Some(dir) = self.parts()
            && let Some(part) = dir.get(id, n).await?
        {
            return Ok(Some(part));
        }
        let part: Option<(Vec<u8>,)> =
            sqlx::query_as("SELECT data FROM file_parts WHERE file_id = $1 AND n = $2")
                .bind(id)
                .bind(n)
                .fetch_optional(self.reader())
                .await?;
        Ok(part.map(|(data,)| data))
    }

    async fn delete_file(&self, tenant: &str, id: &str) -> Result<bool> {
        // The parts go with the row (ON DELETE CASCADE).
        let done = sqlx::query("DELETE FROM files WHERE id = $1 AND tenant = $2")
            .bind(id)
            .bind(tenant)
            .execute(self.writer())
            .await?;
        let deleted = D::rows_affected(&done) > 0;
        if deleted && let Some(dir) = self.parts() {
            dir.remove(id).await?;
        }
        Ok(deleted)
    }

    async fn sweep_files(&self, begun_before: i64, now: i64) -> Result<u64> {
        let swept: Vec<(String,)> = sqlx::query_as(
            "DELETE FROM files
             WHERE (status = 'uploading' AND created_at < $1)
                OR (expires_at IS NOT NULL AND expires_at < $2)
             RETURNING id",
        )
        .bind(begun_before)
        .bind(now)
        .fetch_all(self.writer())
        .await?;
        if let Some(dir) = self.parts() {
            for (id,) in &swept {
                dir.remove(id).await?;
            }
        }
        Ok(swept.len() as u64)
    }
}
