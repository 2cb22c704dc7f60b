//! `[telemetry]`: OpenTelemetry traces, off unless a collector is named.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

/// Where traces go, if anywhere.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// An OTLP/HTTP collector (`http://collector:4318`): spans are sent
    /// as protobuf to its `/v1/traces`. None: no traces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of the spans.
    pub service_name: String,
    /// How long one export may take before its spans are dropped (and
    /// counted); exports run off the request path.
    #[serde(with = "humantime_serde")]
    pub export_timeout: Duration,
    /// How often queued spans are sent (at most 512 at once, and at once
    /// when 512 are queued).
    #[serde(with = "humantime_serde")]
    pub export_interval: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "idem".into(),
            export_timeout: Duration::from_secs(5),
            export_interval: Duration::from_secs(5),
        }
    }
}

impl TelemetryConfig {
    /// The checks of `[telemetry]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if let Some(e) = &self.otlp_endpoint
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(source.invalid(
                "telemetry.otlp_endpoint",
                "must be an http:// or https:// URL (an OTLP/HTTP collector, such as http://127.0.0.1:4318)",
            ));
        }
        if self.service_name.is_empty() {
            return Err(source.invalid("telemetry.service_name", "must not be empty"));
        }
        if self.export_interval < Duration::from_millis(10) {
            return Err(source.invalid("telemetry.export_interval", "must be at least 10ms"));
        }
        if self.export_timeout < Duration::from_millis(10) {
            return Err(source.invalid("telemetry.export_timeout", "must be at least 10ms"));
        }
        Ok(())
    }

    /// The URL spans are posted to: the endpoint's `/v1/traces`, unless it
    /// names that path already.
    pub fn traces_url(&self) -> Option<String> {
        let e = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        Some(if e.ends_with("/v1/traces") {
            e.to_string()
        } else {
            format!("{e}/v1/traces")
        })
    }
}
