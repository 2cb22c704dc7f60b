//! OpenTelemetry traces (docs/operations.md, "Traces"): off unless
//! `[telemetry] otlp_endpoint` names a collector.
//!
//! A request is a span (`chat bot`, the GenAI conventions' name) under the
//! client's `traceparent` when it sends one; its children are the cache
//! lookup, a follower's wait, which **links to the span of the provider
//! call that answered it**, and, on a leader, the provider call, whose
//! `traceparent` goes to the provider. A job attempt is a span of its own
//! with its provider call under it. Spans are batched and exported off the
//! request path, from the batch processor's thread; an export that fails
//! (a collector down or slow) drops its spans and counts them
//! (`idem_trace_spans_dropped_total`), and costs requests nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Link, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider, SpanData, SpanExporter,
};

use crate::config::TelemetryConfig;

pub use opentelemetry::KeyValue as Attribute;
pub use opentelemetry::trace::{SpanContext as SpanId, SpanKind as Kind};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("telemetry.otlp_endpoint: cannot make the OTLP exporter: {0}")]
    Exporter(String),
}

/// The traces of one gateway: a tracer when they are on.
pub struct Telemetry {
    on: Option<On>,
}

struct On {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

/// One span in progress (a request's, an attempt's, a provider call's),
/// as a context its children are made under, with the tracer that makes
/// them. Cheap to clone; ended once with [`Trace::end`].
///
/// One pointer wide: a waiting request keeps it (see
/// `a_chat_requests_boxed_future_fits_in_1024_bytes`).
#[derive(Clone, Debug)]
pub struct Trace(Arc<Traced>);

#[derive(Debug)]
struct Traced {
    cx: Context,
    tracer: SdkTracer,
}

impl Trace {
    fn new(cx: Context, tracer: SdkTracer) -> Trace {
        Trace(Arc::new(Traced { cx, tracer }))
    }
}

impl Trace {
    /// Its span's identity, for links and `traceparent`.
    pub fn span_context(&self) -> SpanContext {
        self.0.cx.span().span_context().clone()
    }

    /// Sets attributes on its span.
    pub fn set(&self, attributes: Vec<KeyValue>) {
        self.0.cx.span().set_attributes(attributes);
    }

    /// Marks its span as failed.
    pub fn fail(&self, why: impl Into<String>) {
        self.0.cx.span().set_status(Status::error(why.into()));
    }

    /// Ends its span now.
    pub fn end(&self) {
        self.0.cx.span().end();
    }

    /// The W3C `traceparent` of its span, for an outgoing call.
    pub fn traceparent(&self) -> Option<String> {
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&self.0.cx, &mut carrier);
        carrier.remove("traceparent")
    }

    /// A child span, started now (or at `started`), linked to `links`;
    /// ended by the caller.
    pub fn child(
        &self,
        name: &'static str,
        kind: SpanKind,
        started: Option<Instant>,
        links: Vec<SpanContext>,
        attributes: Vec<KeyValue>,
    ) -> Trace {
        let mut builder = self
            .0
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .with_links(
                links
                    .into_iter()
                    .filter(SpanContext::is_valid)
                    .map(Link::with_context)
                    .collect(),
            );
        if let Some(at) = started {
            builder = builder.with_start_time(system_time_of(at));
        }
        let span = builder.start_with_context(&self.0.tracer, &self.0.cx);
        Trace::new(self.0.cx.with_span(span), self.0.tracer.clone())
    }
}

/// Ends a span when dropped: on every way out of the work it measures.
pub struct EndOnDrop(pub Trace);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A span exporter that counts the spans of the batches it could not
/// export.
#[derive(Debug)]
struct Counting<E> {
    inner: E,
    dropped: metrics::Counter,
}

impl<E: SpanExporter> SpanExporter for Counting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let result = self.inner.export(batch).await;
        if result.is_err() {
            self.dropped.increment(n);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Header pairs as OpenTelemetry's carrier.
struct Headers<'a>(&'a [(&'a str, &'a str)]);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| *v)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| *k).collect()
    }
}

impl Telemetry {
    /// No traces.
    pub fn off() -> Telemetry {
        Telemetry { on: None }
    }

    /// Traces to the configured collector, or none. `dropped` counts the
    /// spans of failed exports.
    pub fn from_config(
        config: &TelemetryConfig,
        dropped: metrics::Counter,
    ) -> Result<Telemetry, TelemetryError> {
        let Some(url) = config.traces_url() else {
            return Ok(Telemetry::off());
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        let batch = BatchSpanProcessor::builder(Counting {
            inner: exporter,
            dropped,
        })
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(config.export_interval)
                .build(),
        )
        .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batch)
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("idem");
        Ok(Telemetry {
            on: Some(On {
                provider,
                tracer,
                propagator: TraceContextPropagator::new(),
            }),
        })
    }

    pub fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// A request's span, `name`d, under the client's trace when its
    /// headers carry a valid `traceparent` (and `tracestate`).
    pub fn request(&self, name: String, headers: &[(&str, &str)]) -> Option<Trace> {
        let on = self.on.as_ref()?;
        let parent = on.propagator.extract(&Headers(headers));
        let span = on
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .start_with_context(&on.tracer, &parent);
        Some(Trace::new(parent.with_span(span), on.tracer.clone()))
    }

    /// A span of its own (a job attempt's), in a trace of its own.
    pub fn root(&self, name: String, attributes: Vec<KeyValue>) -> Option<Trace> {
        let on = self.on.as_ref()?;
        let span = on
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_attributes(attributes)
            .start_with_context(&on.tracer, &Context::new());
        Some(Trace::new(
            Context::new().with_span(span),
            on.tracer.clone(),
        ))
    }

    /// Exports what is queued and stops (at shutdown).
    pub fn shutdown(&self) {
        if let Some(on) = &self.on {
            match on.provider.shutdown() {
                Ok(()) | Err(OTelSdkError::AlreadyShutdown) => {}
                Err(e) => tracing::warn!(error = %e, "traces: the last export failed"),
            }
        }
    }
}

/// The wall-clock time of a monotonic instant in the past.
fn system_time_of(at: Instant) -> SystemTime {
    let now = SystemTime::now();
    now.checked_sub(at.elapsed()).unwrap_or(now)
}

/// The GenAI semantic conventions' attribute names, and idem's own.
pub mod attr {
    pub const OPERATION: &str = "gen_ai.operation.name";
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    pub const PROVIDER: &str = "gen_ai.provider.name";
    pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    pub const OUTCOME: &str = "idem.outcome";
    pub const FINGERPRINT: &str = "idem.fingerprint";
    pub const TENANT: &str = "idem.tenant";
    pub const ROUTE: &str = "idem.route";
    pub const JOB: &str = "idem.job";
    pub const ATTEMPT: &str = "idem.attempt";
    pub const STATUS: &str = "http.response.status_code";
}

/// A span's name in the GenAI conventions: `{operation} {model}`.
pub fn span_name(operation: &str, model: &str) -> String {
    format!("{operation} {model}")
}

/// The GenAI conventions' name of a provider kind.
pub fn provider_name(kind: crate::config::ProviderKind) -> &'static str {
    match kind {
        crate::config::ProviderKind::Openai => "openai",
        crate::config::ProviderKind::Anthropic => "anthropic",
        crate::config::ProviderKind::Azure => "azure.ai.openai",
        crate::config::ProviderKind::Mock => "idem.mock",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_go_to_the_collectors_v1_traces() {
        let c = |e: &str| TelemetryConfig {
            otlp_endpoint: Some(e.into()),
            ..TelemetryConfig::default()
        };
        assert_eq!(
            c("http://c:4318").traces_url().as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(
            c("http://c:4318/v1/traces/").traces_url().as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(TelemetryConfig::default().traces_url(), None);
    }

    #[test]
    fn off_makes_no_spans() {
        let t = Telemetry::off();
        assert!(!t.is_on());
        assert!(t.request("chat bot".into(), &[]).is_none());
    }
}
