//! `[log]`: the format of the log and where the per-request log goes.

use serde::{Deserialize, Serialize};

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
