//! Stored responses (`store: true` on `POST /v1/responses`): `GET
//! /v1/responses/{id}` returns one, `DELETE` removes it. Every lookup is
//! scoped to the caller's tenant: another tenant's id is 404, never 403.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use quick_cache::sync::{Cache, EntryAction, EntryResult};
use serde_json::{Value, json};
use tokio::sync::OnceCell;

use super::error::ApiError;
use super::{ApiPath, AppState, Caller};
use crate::store::{StoreError, StoredResponse};

/// The responses this replica kept a moment ago. Every asker of a shared
/// answer with `store: true` keeps the same response (same tenant, same
/// id, same body): a wave of them writes it once, the others wait for that
/// write, instead of a row write per asker. Forgotten after a minute (well
/// within any retention) or when the response is deleted.
pub struct Kept {
    written: Cache<KeptKey, (Instant, Arc<OnceCell<()>>)>,
    /// How long a write is remembered.
    remember: Duration,
}

/// A kept response's tenant and id.
type KeptKey = (Arc<str>, Arc<str>);

impl Default for Kept {
    fn default() -> Self {
        Kept::new()
    }
}

impl Kept {
    pub fn new() -> Kept {
        Kept::remembering(Duration::from_secs(60))
    }

    /// Remembers each write for `remember`, and at most 100,000 of them.
    fn remembering(remember: Duration) -> Kept {
        Kept {
            written: Cache::new(100_000),
            remember,
        }
    }

    /// Keeps `kept` in `store`, unless this replica kept it a moment ago.
    pub async fn keep(
        &self,
        store: &dyn crate::store::Store,
        kept: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.once(&kept.tenant, &kept.id, || store.put_response(kept))
            .await
    }

    /// Runs `write` for `(tenant, id)` unless a write for it succeeded a
    /// moment ago; concurrent callers wait for the one that runs, and try
    /// again if it failed.
    async fn once<F, Fut>(&self, tenant: &str, id: &str, write: F) -> Result<(), StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), StoreError>>,
    {
        let key: KeptKey = (Arc::from(tenant), Arc::from(id));
        let remembered = self.written.entry(&key, None, |_, (at, cell)| {
            if at.elapsed() < self.remember {
                EntryAction::Retain(cell.clone())
            } else {
                EntryAction::ReplaceWithGuard
            }
        });
        let cell = match remembered {
            EntryResult::Retained(cell) => cell,
            EntryResult::Vacant(guard) | EntryResult::Replaced(guard, _) => {
                let cell = Arc::new(OnceCell::new());
                let _ = guard.insert((Instant::now(), cell.clone()));
                cell
            }
            // (neither is asked for: no removal, no timeout)
            EntryResult::Removed(..) | EntryResult::Timeout => Arc::new(OnceCell::new()),
        };
        cell.get_or_try_init(write).await.map(|_| ())
    }

    /// The response is gone: the next asker keeps it again.
    pub fn forget(&self, tenant: &str, id: &str) {
        self.written
            .remove(&(Arc::<str>::from(tenant), Arc::<str>::from(id)));
    }
}

/// `GET /v1/responses/{id}`: the response object as its asker got it.
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let kept = app
        .store
        .response(&tenant, &id)
        .await?
        .ok_or(ApiError::NotFound("response"))?;
    serde_json::from_str(&kept.body)
        .map(Json)
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("stored response {id} is unreadable: {e}")))
}

/// `DELETE /v1/responses/{id}`: `{"id", "object": "response.deleted",
/// "deleted": true}`, as OpenAI answers.
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    app.kept.forget(&tenant, &id);
    if !app.store.delete_response(&tenant, &id).await? {
        return Err(ApiError::NotFound("response"));
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_wave_keeps_its_response_once_and_a_deleted_one_again() {
        let kept = Arc::new(Kept::new());
        let writes = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(tokio::sync::Barrier::new(100));
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let (kept, writes, barrier) = (kept.clone(), writes.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    kept.once("t1", "resp_a", || async {
                        writes.fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        Ok(())
                    })
                    .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        // Another tenant's response of the same id is its own.
        let write = || async {
            writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        kept.once("t2", "resp_a", write).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 2);
        // A failed write is tried again by the next asker.
        let failed = kept
            .once("t1", "resp_b", || async {
                Err(StoreError::Corrupt("no".into()))
            })
            .await;
        assert!(failed.is_err());
        kept.once("t1", "resp_b", write).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 3);
        // Deleted: kept again.
        kept.forget("t1", "resp_a");
        kept.once("t1", "resp_a", write).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_write_is_remembered_for_a_while_only() {
        let kept = Kept::remembering(Duration::from_millis(300));
        let writes = AtomicUsize::new(0);
        let write = || async {
            writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        kept.once("t1", "resp_a", write).await.unwrap();
        kept.once("t1", "resp_a", write).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(350)).await;
        kept.once("t1", "resp_a", write).await.unwrap();
        assert_eq!(
            writes.load(Ordering::SeqCst),
            2,
            "written again once forgotten"
        );
        kept.once("t1", "resp_a", write).await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 2);
    }
}
