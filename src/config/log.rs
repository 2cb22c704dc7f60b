//! `[log]`: the format of the log and where the per-request log goes.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `json` (one object per line) or `text`.
    pub format: String,
    /// Where the per-request log goes: `stdout`, `off`, or a file path.
    pub requests: String,
    /// Include message contents in the request log.
    pub bodies: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: "text".into(),
            requests: "stdout".into(),
            bodies: false,
        }
    }
}

impl LogConfig {
    /// The checks of `[log]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if !matches!(self.format.as_str(), "text" | "json") {
            return Err(source.invalid("log.format", "expected \"text\" or \"json\""));
        }
        if self.requests.is_empty() {
            return Err(source.invalid(
                "log.requests",
                "expected \"stdout\", \"off\" or a file path",
            ));
        }
        Ok(())
    }
}
