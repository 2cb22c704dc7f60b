//! The one place where an error becomes an HTTP answer: every failure a
//! client can see is an [`ApiError`], rendered as the OpenAI error object
//! `{"error": {"message", "type", "code", "param"}}` with its status.
//!
//! Internal failures keep their source chain for the log and show the
//! client nothing but "internal error".

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::certification::failover::NoTarget;
use crate::flight::FlightError;
use crate::jobs::JobError;
use crate::live::ReloadError;
use crate::outcome::Refusal;
use crate::task::TaskError;

pub use crate::answer::error_body;

/// Every error a client can receive from idem.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid API key")]
    Unauthorized,
    /// A key of the store that no longer admits anybody (revoked,
    /// expired): the message says which.
    #[error("{0}")]
    KeyRefused(String),
    /// The key may not do this (a route outside its allowlist, a call
    /// whose cost a budget cannot count).
    #[error("{message}")]
    Forbidden { message: String, code: &'static str },
    /// The key's or its tenant's budget cannot hold the request's worst
    /// case (docs/design.md, "Keys and budgets").
    #[error("{message}")]
    BudgetExceeded {
        message: String,
        retry_after: Option<u64>,
    },
    /// The key's requests or tokens per minute are spent.
    #[error("{message}")]
    KeyRateLimited {
        message: String,
        retry_after: u64,
        remaining_requests: Option<u64>,
        remaining_tokens: Option<u64>,
    },
    #[error("this endpoint needs an admin key")]
    AdminOnly,
    #[error("this endpoint needs a tenant key, not an admin key")]
    TenantOnly,
    #[error("{message}")]
    BadRequest {
        message: String,
        code: &'static str,
        param: Option<String>,
    },
    #[error("request body larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("the request head (request line and headers) is larger than {limit} bytes")]
    HeadTooLarge { limit: usize },
    #[error("the request body did not arrive within {limit:?}")]
    BodyTimeout { limit: Duration },
    /// `available`: the models the caller may use for this endpoint, so
    /// that a typo is fixed from the error alone (None: not listed).
    #[error("model `{model}` does not exist{}", available_models(available.as_deref()))]
    ModelNotFound {
        model: String,
        available: Option<Vec<String>>,
    },
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("{message}")]
    Conflict { message: String, code: &'static str },
    #[error("waited {waited:?} for an identical request in flight")]
    WaitTimeout { waited: Duration, retry_after: u64 },
    #[error("the job is still in progress")]
    JobInProgress {
        job_id: String,
        /// The request created the job: the job's first attempt counts it
        /// as the job's one incoming request.
        created: bool,
    },
    #[error("{message}")]
    Upstream {
        status: StatusCode,
        message: String,
        code: &'static str,
        retry_after: Option<u64>,
    },
    #[error("too many requests")]
    RateLimited { retry_after: u64 },
    #[error("service unavailable: {0}")]
    Unavailable(&'static str),
    /// The gateway is at one of its bounds for the moment: 503 with
    /// `Retry-After`.
    #[error("the gateway is busy: {what}; retry in {retry_after} s")]
    Busy {
        what: &'static str,
        retry_after: u64,
    },
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

/// How many models an unknown model's 404 lists at most.
const LISTED_MODELS: usize = 20;

/// The end of an unknown model's message: the models to use instead.
fn available_models(models: Option<&[String]>) -> String {
    let Some(models) = models else {
        return String::new();
    };
    if models.is_empty() {
        return "; no model serves this endpoint here".into();
    }
    let mut list: Vec<String> = models
        .iter()
        .take(LISTED_MODELS)
        .map(|m| format!("`{m}`"))
        .collect();
    if models.len() > LISTED_MODELS {
        list.push(format!(
            "and {} more (GET /v1/models)",
            models.len() - LISTED_MODELS
        ));
    }
    format!("; this key may use {}", list.join(", "))
}

impl ApiError {
    pub fn bad_request(
        message: impl Into<String>,
        code: &'static str,
        param: Option<&str>,
    ) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            code,
            param: param.map(str::to_owned),
        }
    }

    pub fn internal(e: impl Into<anyhow::Error>) -> Self {
        ApiError::Internal(e.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized | ApiError::KeyRefused(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } => StatusCode::FORBIDDEN,
            ApiError::BudgetExceeded { .. } | ApiError::KeyRateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::AdminOnly | ApiError::TenantOnly => StatusCode::FORBIDDEN,
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::ModelNotFound { .. } | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::WaitTimeout { .. } | ApiError::JobInProgress { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ApiError::Upstream { status, .. } => *status,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) | ApiError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type` and `code` fields.
    pub(super) fn kind(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::Unauthorized | ApiError::KeyRefused(_) => {
                ("invalid_request_error", "invalid_api_key")
            }
            ApiError::Forbidden { code, .. } => ("permission_error", code),
            ApiError::BudgetExceeded { .. } => ("rate_limit_error", "budget_exceeded"),
            ApiError::KeyRateLimited { .. } => ("rate_limit_error", "rate_limit_exceeded"),
            ApiError::AdminOnly => ("permission_error", "admin_key_required"),
            ApiError::TenantOnly => ("permission_error", "tenant_key_required"),
            ApiError::BadRequest { code, .. } => ("invalid_request_error", code),
            ApiError::PayloadTooLarge { .. } => ("invalid_request_error", "request_too_large"),
            ApiError::BodyTimeout { .. } => ("invalid_request_error", "body_timeout"),
            ApiError::HeadTooLarge { .. } => ("invalid_request_error", "request_head_too_large"),
            ApiError::ModelNotFound { .. } => ("invalid_request_error", "model_not_found"),
            ApiError::NotFound(_) => ("invalid_request_error", "not_found"),
            ApiError::Conflict { code, .. } => ("invalid_request_error", code),
            ApiError::WaitTimeout { .. } => ("timeout_error", "coalesce_wait_timeout"),
            ApiError::JobInProgress { .. } => ("timeout_error", "job_in_progress"),
            ApiError::Upstream { code, .. } => ("upstream_error", code),
            ApiError::RateLimited { .. } => ("rate_limit_error", "rate_limit_exceeded"),
            ApiError::Unavailable(_) => ("server_error", "unavailable"),
            ApiError::Busy { .. } => ("server_error", "server_busy"),
            ApiError::Internal(_) => ("server_error", "internal_error"),
        }
    }

    /// True when the request is counted elsewhere: it created a job, whose
    /// first attempt counts it (one job, one incoming request).
    pub fn counted_by_its_job(&self) -> bool {
        matches!(self, ApiError::JobInProgress { created: true, .. })
    }

    /// How a chat completion request that ends with this error is counted
    /// (the `outcome` label of `idem_requests_total`).
    pub fn refusal(&self) -> Refusal {
        match self {
            ApiError::Unauthorized
            | ApiError::KeyRefused(_)
            | ApiError::Forbidden { .. }
            | ApiError::BudgetExceeded { .. }
            | ApiError::KeyRateLimited { .. }
            | ApiError::AdminOnly
            | ApiError::TenantOnly
            | ApiError::BadRequest { .. }
            | ApiError::PayloadTooLarge { .. }
            | ApiError::BodyTimeout { .. }
            | ApiError::HeadTooLarge { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::NotFound(_)
            | ApiError::Conflict { .. }
            | ApiError::RateLimited { .. } => Refusal::Rejected,
            ApiError::WaitTimeout { .. } => Refusal::WaitTimeout,
            ApiError::JobInProgress { .. } => Refusal::JobTimeout,
            // The failover rule's answer when every target is skipped.
            ApiError::Upstream {
                code: "no_target_available",
                ..
            } => Refusal::NoTarget,
            ApiError::Upstream { .. }
            | ApiError::Unavailable(_)
            | ApiError::Busy { .. }
            | ApiError::Internal(_) => Refusal::Error,
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::BadRequest { param, .. } => param.as_deref(),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    fn headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        let retry = match self {
            ApiError::WaitTimeout { retry_after, .. }
            | ApiError::RateLimited { retry_after }
            | ApiError::Busy { retry_after, .. } => Some(*retry_after),
            ApiError::Upstream { retry_after, .. }
            | ApiError::BudgetExceeded { retry_after, .. } => *retry_after,
            ApiError::KeyRateLimited { retry_after, .. } => Some(*retry_after),
            _ => None,
        };
        if let ApiError::KeyRateLimited {
            remaining_requests,
            remaining_tokens,
            ..
        } = self
        {
            for (name, n) in [
                ("x-ratelimit-remaining-requests", remaining_requests),
                ("x-ratelimit-remaining-tokens", remaining_tokens),
            ] {
                if let Some(n) = n {
                    h.insert(HeaderName::from_static(name), HeaderValue::from(*n));
                }
            }
        }
        if let Some(secs) = retry {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let ApiError::JobInProgress { job_id, .. } = self
            && let Ok(v) = HeaderValue::from_str(job_id)
        {
            h.insert(HeaderName::from_static("idem-job-id"), v);
        }
        // The unread rest of an oversized or late body makes the connection
        // unusable: say so, or a keep-alive client sends its next request
        // into a connection that is closing.
        if matches!(
            self,
            ApiError::PayloadTooLarge { .. }
                | ApiError::BodyTimeout { .. }
                | ApiError::HeadTooLarge { .. }
                | ApiError::Busy { .. }
        ) {
            h.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if matches!(self, ApiError::Unauthorized | ApiError::KeyRefused(_)) {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        h
    }
}

/// A refused reload: 409, the configuration in force stays.
impl From<ReloadError> for ApiError {
    fn from(e: ReloadError) -> Self {
        let code = match &e {
            ReloadError::NoSource => "reload_unavailable",
            ReloadError::Invalid(_) | ReloadError::Build(_) => "invalid_config",
            ReloadError::NeedsRestart(_) => "restart_required",
        };
        ApiError::Conflict {
            message: e.to_string(),
            code,
        }
    }
}

impl From<NoTarget> for ApiError {
    /// 503 `no_target_available`; the message names targets and reasons
    /// (no addresses, no internals).
    fn from(n: NoTarget) -> ApiError {
        ApiError::Upstream {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: n.to_string(),
            code: "no_target_available",
            retry_after: n.retry_after(),
        }
    }
}

impl From<FlightError> for ApiError {
    fn from(e: FlightError) -> ApiError {
        match e {
            FlightError::WaitTimeout {
                waited,
                retry_after,
            } => ApiError::WaitTimeout {
                waited,
                retry_after,
            },
            FlightError::BodyLost => ApiError::Internal(anyhow::Error::new(e)),
            FlightError::Budget(b) => b.into(),
        }
    }
}

impl From<crate::budgets::BudgetError> for ApiError {
    fn from(e: crate::budgets::BudgetError) -> ApiError {
        use crate::budgets::BudgetError;
        let message = e.to_string();
        match e {
            BudgetError::Exceeded { retry_after, .. } => ApiError::BudgetExceeded {
                message,
                retry_after,
            },
            BudgetError::PriceUnknown { .. } => ApiError::Forbidden {
                message,
                code: "price_unknown",
            },
            BudgetError::Unavailable(_) => ApiError::Unavailable("the budget store"),
        }
    }
}

impl From<TaskError> for ApiError {
    fn from(e: TaskError) -> ApiError {
        match e {
            TaskError::Flight(e) => e.into(),
            TaskError::NoTarget(n) => n.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let ApiError::Internal(e) = &self {
            tracing::error!(error = format!("{e:#}"), "internal error");
        }
        let (kind, code) = self.kind();
        let message = self.to_string();
        // Off by default (a refusal is the client's business); on with
        // `RUST_LOG=idem::refused=debug` to see every request idem refused
        // and why (the agents check fails on any).
        tracing::debug!(target: "idem::refused", status = status.as_u16(), code, %message, "refused");
        let body = error_body(&message, kind, code, self.param());
        (status, self.headers(), axum::Json(body)).into_response()
    }
}

impl From<crate::translate::Refusal> for ApiError {
    /// A request of the Messages or Responses face that a chat request
    /// cannot say: 400 `invalid_request` with the field at fault.
    fn from(r: crate::translate::Refusal) -> ApiError {
        ApiError::bad_request(r.message, "invalid_request", r.param.as_deref())
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> ApiError {
        let message = e.to_string();
        let conflict = |code| ApiError::Conflict { message, code };
        match e {
            JobError::KeyReused => conflict("idempotency_key_reused"),
            JobError::NotFound => ApiError::NotFound("job"),
            JobError::AttemptNotFound => ApiError::NotFound("attempt"),
            JobError::InProgress { job_id } => ApiError::JobInProgress {
                job_id,
                created: false,
            },
            JobError::Closed { .. } | JobError::Succeeded | JobError::Lost => {
                conflict("job_completed")
            }
            JobError::AttemptInProgress => conflict("attempt_in_progress"),
            JobError::NotUnknown { .. } | JobError::AttemptChanged { .. } => {
                conflict("attempt_not_unknown")
            }
            JobError::Store(e) => e.into(),
        }
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        match e {
            crate::store::StoreError::Unavailable(_) => {
                tracing::error!(error = format!("{e:#}"), "store unavailable");
                ApiError::Unavailable("storage")
            }
            other => ApiError::Internal(other.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn internal_details_never_reach_the_client() {
        let err = ApiError::internal(anyhow::anyhow!("password=hunter2 at db.internal:5432"));
        let resp = err.into_response();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "internal_error");
        assert_eq!(v["error"]["type"], "server_error");
    }

    #[test]
    fn each_error_is_counted_under_its_refusal() {
        let no_target = ApiError::from(NoTarget(Vec::new()));
        assert_eq!(no_target.refusal(), Refusal::NoTarget);
        let upstream = ApiError::Upstream {
            status: StatusCode::BAD_GATEWAY,
            message: "x".into(),
            code: "job_failed",
            retry_after: None,
        };
        for (err, expected) in [
            (ApiError::Unauthorized, Refusal::Rejected),
            (ApiError::TenantOnly, Refusal::Rejected),
            (ApiError::PayloadTooLarge { limit: 1 }, Refusal::Rejected),
            (
                ApiError::BodyTimeout {
                    limit: Duration::from_secs(1),
                },
                Refusal::Rejected,
            ),
            (
                ApiError::ModelNotFound {
                    model: "m".into(),
                    available: None,
                },
                Refusal::Rejected,
            ),
            (ApiError::RateLimited { retry_after: 1 }, Refusal::Rejected),
            (
                ApiError::WaitTimeout {
                    waited: Duration::from_secs(1),
                    retry_after: 1,
                },
                Refusal::WaitTimeout,
            ),
            (
                ApiError::JobInProgress {
                    job_id: "j".into(),
                    created: false,
                },
                Refusal::JobTimeout,
            ),
            (upstream, Refusal::Error),
            (ApiError::Unavailable("storage"), Refusal::Error),
        ] {
            assert_eq!(err.refusal(), expected, "{err:?}");
        }
    }

    #[tokio::test]
    async fn a_late_body_is_408_and_closes_the_connection() {
        let resp = ApiError::BodyTimeout {
            limit: Duration::from_secs(30),
        }
        .into_response();
        assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(resp.headers()[header::CONNECTION], "close");
    }

    #[tokio::test]
    async fn wait_timeout_carries_retry_after() {
        let resp = ApiError::WaitTimeout {
            waited: Duration::from_secs(1),
            retry_after: 3,
        }
        .into_response();
        assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
    }
}
