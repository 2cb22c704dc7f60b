//! The intake: request bodies being read and parsed, bounded together
//! (docs/design.md, "Bounds on what a client can make idem hold").
//!
//! Each body is bounded on its own (`server.max_body_bytes`, then the JSON
//! limits of `validate`); the intake bounds them all at once: a body
//! reserves its bytes from `server.max_inflight_body_bytes` before it is
//! read (its `Content-Length`, else its limit) and holds them until it has
//! been parsed and checked. A request that cannot reserve them within
//! [`WAIT`] gets a 503 with `Retry-After`, so that N clients sending large
//! or hostile bodies at once cannot take the process past its ceiling.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use super::validate;

/// How long a body waits for its share of the intake before a 503.
pub const WAIT: Duration = Duration::from_secs(2);

/// The budget of body bytes being read and parsed at once.
#[derive(Debug, Clone)]
pub struct Intake {
    budget: Arc<Semaphore>,
    total: usize,
}

/// A body's share of the intake, given back when dropped.
#[derive(Debug)]
pub struct Share {
    _permit: Option<OwnedSemaphorePermit>,
}

impl Intake {
    /// An intake of `total` bytes (at least the largest body it must take).
    pub fn new(total: usize) -> Intake {
        let total = total.min(u32::MAX as usize);
        Intake {
            budget: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Bytes not reserved now (for tests and the metrics).
    pub fn available(&self) -> usize {
        self.budget.available_permits()
    }

    /// Reads a body of at most `limit` bytes (413 past it) once its bytes
    /// are reserved; the [`Share`] holds them until the caller drops it,
    /// after parsing.
    pub async fn read(
        &self,
        body: Body,
        content_length: Option<u64>,
        limit: usize,
    ) -> Result<(Bytes, Share), ApiError> {
        if content_length.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        let wanted = content_length
            .map_or(limit, |n| usize::try_from(n).unwrap_or(limit))
            .min(limit)
            .min(self.total);
        let mut permit = self.reserve(wanted).await?;
        let bytes = validate::read_body(body, content_length, limit).await?;
        // A body without a length reserved its limit: keep what it is.
        if let Some(permit) = permit.as_mut()
            && bytes.len() < wanted
        {
            drop(permit.split(wanted - bytes.len()));
        }
        Ok((bytes, Share { _permit: permit }))
    }

    /// Holds `n` bytes (at most the whole budget) for a body read as a
    /// stream a bounded piece at a time (a file upload): what it buffers
    /// at once counts against the budget like a whole body.
    pub async fn hold(&self, n: usize) -> Result<Share, ApiError> {
        let permit = self.reserve(n.min(self.total)).await?;
        Ok(Share { _permit: permit })
    }

    async fn reserve(&self, n: usize) -> Result<Option<OwnedSemaphorePermit>, ApiError> {
        if n == 0 {
            return Ok(None);
        }
        // `n` is at most `total`, which fits in a u32.
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        match tokio::time::timeout(WAIT, self.budget.clone().acquire_many_owned(n)).await {
            Ok(Ok(permit)) => Ok(Some(permit)),
            // Closed (never) or no room in time.
            _ => Err(ApiError::Busy {
                what: "request bodies being read at once are at server.max_inflight_body_bytes",
                retry_after: 1,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bodies reserve their length while read and parsed; past the budget
    /// a body waits, and gets a 503 once `WAIT` has passed; a body
    /// without a length reserves its limit, then only what it was.
    #[tokio::test(start_paused = true)]
    async fn bodies_share_the_budget_and_wait_past_it() {
        let intake = Intake::new(100);
        let (bytes, first) = intake
            .read(Body::from(vec![b'x'; 60]), Some(60), 80)
            .await
            .unwrap();
        assert_eq!(bytes.len(), 60);
        assert_eq!(intake.available(), 40);
        // 60 more do not fit: a 503 with Retry-After after WAIT.
        let started = tokio::time::Instant::now();
        let e = intake
            .read(Body::from(vec![b'x'; 60]), Some(60), 80)
            .await
            .unwrap_err();
        assert!(matches!(e, ApiError::Busy { .. }), "{e:?}");
        assert_eq!(e.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(started.elapsed() >= WAIT);
        // A body that fits is read at once.
        let (_, second) = intake
            .read(Body::from(vec![b'x'; 40]), Some(40), 80)
            .await
            .unwrap();
        assert_eq!(intake.available(), 0);
        // A waiting body goes on as soon as room is given back.
        let waiting = tokio::spawn({
            let intake = intake.clone();
            async move { intake.read(Body::from(vec![b'x'; 50]), None, 60).await }
        });
        tokio::task::yield_now().await;
        drop(first);
        let (bytes, third) = waiting.await.unwrap().unwrap();
        assert_eq!(bytes.len(), 50);
        // It reserved its limit (no length), then kept its 50.
        assert_eq!(intake.available(), 100 - 40 - 50);
        drop((second, third));
        assert_eq!(intake.available(), 100);
    }
}
