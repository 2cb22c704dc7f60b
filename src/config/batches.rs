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
}

impl Default for BatchesConfig {
    fn default() -> Self {
        Self {
            max_file_bytes: 200 * 1024 * 1024,
            file_retention: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

impl BatchesConfig {
    /// The checks of `[batches]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.max_file_bytes == 0 || self.max_file_bytes > 1 << 40 {
            return Err(source.invalid("batches.max_file_bytes", "expected 1 byte to 1 TiB"));
        }
        if self.file_retention < Duration::from_secs(60) {
            return Err(source.invalid("batches.file_retention", "expected at least 1m"));
        }
        Ok(())
    }
}
