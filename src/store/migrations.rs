//! The store's migrations, embedded in the binary: each backend's
//! `migrations/<backend>/<VERSION>_<DESCRIPTION>.sql`, read as sqlx reads
//! a directory (the description's underscores become spaces, a first line
//! `-- no-transaction` runs it outside a transaction, the checksum is the
//! SHA-384 of the text), so that databases migrated before keep their
//! history. Listed by hand rather than by sqlx's `migrate!` macro, which
//! would compile both database drivers a second time, for the compiler;
//! a test checks the lists against the directories.

use std::borrow::Cow;

use futures_util::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::{AssertSqlSafe, SqlSafeStr};

use super::Result;

/// A migration: its file name and text.
type Embedded = (&'static str, &'static str);

macro_rules! embedded {
    ($dir:literal: $($file:literal),* $(,)?) => {
        &[$(($file, include_str!(concat!("../../migrations/", $dir, "/", $file)))),*]
    };
}

/// SQLite's migrations, in order.
pub(super) const SQLITE: &[Embedded] = embedded!("sqlite":
    "0001_jobs.sql",
    "0002_jobs_created.sql",
    "0003_job_queue.sql",
    "0004_job_retries.sql",
    "0005_responses.sql",
    "0006_dialects.sql",
    "0007_keys.sql",
    "0008_files.sql",
    "0009_batches.sql",
    "0010_provider_batches.sql",
);

/// PostgreSQL's migrations, in order.
pub(super) const POSTGRES: &[Embedded] = embedded!("postgres":
    "0001_jobs.sql",
    "0002_jobs_created.sql",
    "0003_job_queue.sql",
    "0004_job_retries.sql",
    "0005_responses.sql",
    "0006_dialects.sql",
    "0007_keys.sql",
    "0008_files.sql",
    "0009_batches.sql",
    "0010_provider_batches.sql",
);

#[derive(Debug)]
struct Source(&'static [Embedded]);

impl MigrationSource<'static> for Source {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move {
            self.0
                .iter()
                .map(|(name, sql)| migration(name, sql))
                .collect()
        })
    }
}

fn migration(name: &str, sql: &'static str) -> Result<Migration, BoxDynError> {
    let (version, rest) = name
        .split_once('_')
        .ok_or_else(|| format!("migration {name:?}: expected <VERSION>_<DESCRIPTION>.sql"))?;
    let description = rest
        .strip_suffix(".sql")
        .ok_or_else(|| format!("migration {name:?}: expected a .sql file"))?
        .replace('_', " ");
    Ok(Migration::new(
        version.parse()?,
        Cow::Owned(description),
        MigrationType::Simple,
        AssertSqlSafe(sql).into_sql_str(),
        sql.starts_with("-- no-transaction"),
    ))
}

/// The migrator of a backend's embedded migrations.
pub(super) async fn migrator(list: &'static [Embedded]) -> Result<Migrator> {
    Ok(Migrator::new(Source(list)).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file of a backend's directory is embedded, in order, and
    /// nothing else: a migration added to the directory but not here
    /// would never run.
    #[test]
    fn the_lists_are_the_directories() {
        for (dir, list) in [("sqlite", SQLITE), ("postgres", POSTGRES)] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(dir);
            let mut files: Vec<String> = std::fs::read_dir(&path)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            files.sort();
            let embedded: Vec<&str> = list.iter().map(|(name, _)| *name).collect();
            assert_eq!(files, embedded, "migrations/{dir}");
        }
    }

    /// Read as sqlx reads a directory: version, description, checksum.
    #[test]
    fn migrations_are_read_as_sqlx_reads_them() {
        let m = migration("0002_jobs_created.sql", SQLITE[1].1).unwrap();
        assert_eq!(m.version, 2);
        assert_eq!(m.description, "jobs created");
        assert_eq!(m.migration_type, MigrationType::Simple);
        assert!(!m.no_tx);
        assert_eq!(
            m.checksum.as_ref(),
            sqlx::migrate::Migration::new(
                2,
                Cow::Borrowed("x"),
                MigrationType::Simple,
                AssertSqlSafe(SQLITE[1].1).into_sql_str(),
                false
            )
            .checksum
            .as_ref()
        );
        assert!(migration("jobs.sql", "").is_err());
    }
}
