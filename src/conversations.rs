//! Stored responses and the conversations they continue (`store: true` and
//! `previous_response_id` on the Responses API; docs/design.md,
//! "Endpoints: one core, several dialects").
//!
//! Each response is kept once, per tenant, with its own turn only: the
//! request's input items and the answer's output items, and the id of the
//! response it continued. A request that continues one is sent with the
//! whole conversation spelled out as input items (the provider keeps
//! nothing: idem asks it with `store: false`), read back along the chain,
//! oldest turn first, and bounded by `responses.max_conversation_bytes`. A
//! chain of N turns stores N turns, not N^2.
//!
//! Deleting a response removes it from the store and its answer from every
//! cache that could serve it again ([`evict`]): a later identical request
//! makes a new call with a new id.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quick_cache::sync::{Cache, EntryAction, EntryResult};
use serde_json::{Map, Value, json};
use tokio::sync::OnceCell;

use crate::answer::Answer;
use crate::fingerprint::Fingerprint;
use crate::flight::Coalescer;
use crate::store::{Store, StoreError, StoredResponse};

/// Why a conversation cannot be continued.
#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    /// No response of this tenant by that id (another tenant's included).
    #[error("previous response {0} not found")]
    NotFound(String),
    /// The conversation is larger than the limit.
    #[error(
        "the conversation continued from {id} is larger than responses.max_conversation_bytes \
         ({limit} bytes): start a new one, or send its turns as input"
    )]
    TooLong { id: String, limit: usize },
    /// A stored turn cannot be read (a bug or a damaged store).
    #[error("stored response {0} has unreadable turns")]
    Unreadable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What a Responses request adds to its task: what keeping its answer
/// needs.
#[derive(Debug, Clone)]
pub struct Turn {
    /// `store` (OpenAI's default: true): kept for `GET` and continuation.
    pub store: bool,
    /// The response it continues.
    pub previous: Option<String>,
    /// Its own input, as items.
    pub input: Vec<Value>,
}

/// A Responses request's turn, and (when it continues a stored response)
/// the request to send instead of it: the conversation's items, then its
/// own input (`previous_response_id` stays for the answer to echo; a
/// target that speaks Responses is sent the request without it).
pub async fn continued(
    store: &dyn Store,
    tenant: &str,
    request: &Map<String, Value>,
    limit: usize,
) -> Result<(Turn, Option<Map<String, Value>>), ConversationError> {
    let input = match request.get("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    let previous = request
        .get("previous_response_id")
        .and_then(Value::as_str)
        .map(str::to_string);
    let turn = Turn {
        store: request.get("store").and_then(Value::as_bool) != Some(false),
        previous: previous.clone(),
        input,
    };
    let Some(id) = previous else {
        return Ok((turn, None));
    };
    let mut items = conversation(store, tenant, &id, limit).await?;
    items.extend(turn.input.iter().cloned());
    let mut send = request.clone();
    send.insert("input".into(), Value::Array(items));
    Ok((turn, Some(send)))
}

/// The items of the conversation up to and including response `id`,
/// oldest first: each turn's input, then its output. Reasoning items
/// without their `encrypted_content` are left out: with idem's `store:
/// false`, a provider cannot read them back.
async fn conversation(
    store: &dyn Store,
    tenant: &str,
    id: &str,
    limit: usize,
) -> Result<Vec<Value>, ConversationError> {
    let mut turns: Vec<Vec<Value>> = Vec::new();
    let mut seen = HashSet::new();
    let mut bytes = 0usize;
    let mut next = Some(id.to_string());
    while let Some(at) = next.take() {
        if !seen.insert(at.clone()) {
            break;
        }
        let Some(row) = store.response(tenant, &at).await? else {
            // The one asked for must exist; an older one may have expired
            // or been deleted: the conversation starts after it.
            if at == id {
                return Err(ConversationError::NotFound(id.to_string()));
            }
            break;
        };
        bytes += row.turns.len();
        if bytes > limit {
            return Err(ConversationError::TooLong {
                id: id.to_string(),
                limit,
            });
        }
        let Ok(Value::Array(items)) = serde_json::from_str::<Value>(&row.turns) else {
            return Err(ConversationError::Unreadable(at));
        };
        if row.format >= 2 {
            turns.push(items);
            next = row.previous_id;
        } else {
            // A response kept before turns were kept one by one: its
            // `turns` is the whole conversation, as chat messages.
            turns.push(items_of_chat(&items));
        }
    }
    turns.reverse();
    Ok(turns
        .into_iter()
        .flatten()
        .filter(|item| {
            item.get("type").and_then(Value::as_str) != Some("reasoning")
                || item.get("encrypted_content").is_some_and(|c| c.is_string())
        })
        .collect())
}

/// Chat messages as Responses input items (the turns of a response kept
/// before turns were kept one by one).
fn items_of_chat(messages: &[Value]) -> Vec<Value> {
    let text = |content: &Value| match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    let mut items = Vec::new();
    for m in messages {
        match m.get("role").and_then(Value::as_str).unwrap_or("") {
            role @ ("system" | "developer" | "user" | "assistant") => {
                let content = m.get("content").map(text).unwrap_or_default();
                if !content.is_empty() {
                    items.push(json!({"role": role, "content": content}));
                }
                for call in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    items.push(json!({
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": call.pointer("/function/name"),
                        "arguments": call.pointer("/function/arguments").and_then(Value::as_str).unwrap_or("{}"),
                    }));
                }
            }
            "tool" => items.push(json!({
                "type": "function_call_output",
                "call_id": m.get("tool_call_id"),
                "output": m.get("content").map(text).unwrap_or_default(),
            })),
            _ => {}
        }
    }
    items
}

/// The response a successful answer makes for `turn`: its id and the row
/// that keeps it (`None` for an answer that is not a response object).
pub fn stored(
    tenant: &str,
    fp: &Fingerprint,
    turn: &Turn,
    answer: &Answer,
) -> Option<StoredResponse> {
    if !answer.is_success() {
        return None;
    }
    let response = answer.plain_json()?;
    let id = response.get("id")?.as_str()?.to_string();
    let mut items = turn.input.clone();
    if let Some(Value::Array(output)) = response.get("output") {
        items.extend(output.iter().cloned());
    }
    Some(StoredResponse {
        tenant: tenant.to_string(),
        id,
        body: response.to_string(),
        turns: Value::Array(items).to_string(),
        created_at: crate::store::now_ms(),
        format: 2,
        previous_id: turn.previous.clone(),
        fingerprint: Some(fp.to_string()),
    })
}

/// Deletes a tenant's response and forgets its answer in every cache
/// (this replica's, the shared one, and through it every replica's): true
/// when there was one.
pub async fn delete(
    store: &dyn Store,
    coalescer: &Coalescer,
    kept: &Kept,
    tenant: &str,
    id: &str,
) -> Result<bool, StoreError> {
    let row = store.response(tenant, id).await?;
    if let Some(fp) = row
        .as_ref()
        .and_then(|r| r.fingerprint.as_deref())
        .and_then(|f| f.parse::<Fingerprint>().ok())
    {
        evict(coalescer, &fp).await;
    }
    kept.forget(tenant, id);
    store.delete_response(tenant, id).await
}

/// Forgets the answer of `fp` in this replica's cache and the shared one.
pub async fn evict(coalescer: &Coalescer, fp: &Fingerprint) {
    coalescer.cache.remove(fp);
    if let Some(shared) = coalescer.shared.get()
        && let Err(e) = shared.evict(fp).await
    {
        shared.failed("evict", &e);
    }
}

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
    pub async fn keep(&self, store: &dyn Store, kept: &StoredResponse) -> Result<(), StoreError> {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::store::StoreError;

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
