//! `[batches]`: the Batch API's files and their limits (docs/design.md,
//! "Batches").

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BatchesConfig {
    /// The largest file `POST /v1/files` takes (OpenAI's limit for a batch
    /// input: 200 MB); a larger one is refused (413) as it arrives.
    pub max_file_bytes: u64,
    /// How long an uploaded file is kept (OpenAI keeps a batch file 30
    /// days); it is deleted after, with its content.
    #[serde(with = "humantime_serde")]
    pub file_retention: Duration,
    /// The most lines a batch's input file may have (OpenAI's: 50,000);
    /// a longer one fails the batch in validation.
    pub max_lines: u64,
    /// The most batches a tenant may have with work left at once; one
    /// more is refused (429).
    pub max_active: u32,
    /// The batches one replica drives at once (none on a replica without
    /// job workers); the others wait their turn, or another replica's.
    pub drivers: u32,
    /// The most of `jobs.workers` that batch lines hold at once on one
    /// replica; the rest are kept for live jobs, which are also claimed
    /// first. None: half of `jobs.workers` (at least 1).
    pub workers: Option<usize>,
    /// A directory for the files' contents instead of the database (the
    /// embedded default's SQLite only): one subdirectory per file, made
    /// if missing. None: in the database.
    pub files_dir: Option<std::path::PathBuf>,
}

impl Default for BatchesConfig {
    fn default() -> Self {
        Self {
            max_file_bytes: 200 * 1024 * 1024,
            file_retention: Duration::from_secs(30 * 24 * 3600),
            max_lines: 50_000,
            max_active: 100,
            drivers: 2,
            workers: None,
            files_dir: None,
        }
    }
}

impl BatchesConfig {
    /// How many of a replica's `jobs_workers` batch lines may hold.
    pub fn line_workers(&self, jobs_workers: usize) -> usize {
        self.workers.unwrap_or((jobs_workers / 2).max(1))
    }

    /// The checks of `[batches]` that its types cannot express.
    pub(super) fn validate(
        &self,
        jobs_workers: usize,
        storage_url: &str,
        source: &Source,
    ) -> Result<(), ConfigError> {
        if self.files_dir.is_some() && !storage_url.starts_with("sqlite:") {
            return Err(source.invalid(
                "batches.files_dir",
                "a directory is one machine's: with PostgreSQL, whose replicas share the store, \
                 files stay in the database",
            ));
        }
        if self.max_file_bytes == 0 || self.max_file_bytes > 1 << 40 {
            return Err(source.invalid("batches.max_file_bytes", "expected 1 byte to 1 TiB"));
        }
        if self.file_retention < Duration::from_secs(60) {
            return Err(source.invalid("batches.file_retention", "expected at least 1m"));
        }
        if self.max_lines == 0 || self.max_lines > 10_000_000 {
            return Err(source.invalid("batches.max_lines", "expected 1 to 10,000,000"));
        }
        if self.max_active == 0 {
            return Err(source.invalid("batches.max_active", "must be at least 1"));
        }
        if self.drivers == 0 || self.drivers > 64 {
            return Err(source.invalid("batches.drivers", "expected 1 to 64"));
        }
        if let Some(w) = self.workers
            && (w == 0 || w > jobs_workers.max(1))
        {
            return Err(source.invalid(
                "batches.workers",
                format!("expected 1 to jobs.workers ({jobs_workers})"),
            ));
        }
        Ok(())
    }
}
