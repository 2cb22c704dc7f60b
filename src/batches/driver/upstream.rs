//! A batch's lines sent to a provider's own Batch API (docs/design.md,
//! "Batches"): the unique chat lines of a route whose first target's
//! provider has `batch_api = true` go to it as one provider batch, each
//! line still a job of its own with one attempt, completed (by
//! compare-and-swap, as any attempt) from the provider's output file.
//!
//! What was sent is known from the batch record: before the upload the
//! record says `sending` for the target, and the lines' attempts start;
//! once the provider made its batch, the record says `sent` with its id.
//! A driver that resumes polls a `sent` provider batch again and sends
//! nothing twice; after a crash while `sending` nobody can tell whether
//! the provider took the lines, so their attempts are `unknown`, as a
//! timeout is. A line the provider failed or never answered goes to the
//! job workers (another attempt of its job), unless the batch is
//! stopping: then its job is cancelled.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::{Driver, FileWriter};
use crate::answer::{Answer, Form};
use crate::batches::Planned;
use crate::dialect::{Dialect, Forwarded};
use crate::outcome::Outcome;
use crate::providers::batch_api::{BatchApiError, ProviderBatch};
use crate::routes::Route;
use crate::store::{AttemptState, Completion, JobRecord, StartAttempt, StoreError, now_ms};
use crate::task::{Count, Finish};
use crate::translate::Prepared;

/// The endpoint of the lines sent.
const CHAT: &str = "/v1/chat/completions";

/// How long past the batch's expiry a sent line's attempt stays leased:
/// the provider's own window is the batch's.
const LEASE_MARGIN_MS: i64 = 3_600_000;

/// A provider batch of this batch, as its record keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(super) struct Entry {
    provider: String,
    model: String,
    /// `sending` (the lines' attempts may have started, the provider may or
    /// may not have made a batch) or `sent`.
    state: String,
    /// The provider's batch id, once `sent`.
    batch: Option<String>,
}

fn entries(b: &crate::store::BatchRecord) -> Vec<Entry> {
    b.upstream
        .as_deref()
        .and_then(|u| serde_json::from_str(u).ok())
        .unwrap_or_default()
}

/// How many provider batches the batch's lines were sent in (made by the
/// provider, their ids kept).
pub fn provider_batches(b: &crate::store::BatchRecord) -> usize {
    entries(b).iter().filter(|e| e.state == "sent").count()
}

/// The lines of one target.
pub(super) struct Group {
    route: Arc<Route>,
    /// Lines to send (no attempt yet), written as the provider's input.
    file: Option<FileWriter>,
    to_send: Vec<String>,
    /// Lines whose attempt an earlier run started.
    resumed: Vec<String>,
}

/// The lines of a batch that go to providers' Batch APIs, by target.
#[derive(Default)]
pub(super) struct Groups(Vec<Group>);

impl Groups {
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// An output or error line of a provider batch.
#[derive(Deserialize)]
struct OutLine<'a> {
    custom_id: String,
    #[serde(borrow, default)]
    response: Option<Response<'a>>,
}

#[derive(Deserialize)]
struct Response<'a> {
    status_code: u16,
    #[serde(borrow)]
    body: &'a RawValue,
}

impl Driver {
    /// Whether the lines of `p` go to a provider's Batch API: a chat line,
    /// its route's first target's provider has one, and nobody's budget
    /// must admit each call (a provider batch's calls are not admitted one
    /// by one).
    pub(super) fn sends_upstream(&mut self, p: &Planned) -> bool {
        if self.dialect != Dialect::Chat {
            return false;
        }
        let Some(first) = p.route.targets.first() else {
            return false;
        };
        if first.provider.batch_api().is_none() {
            return false;
        }
        *self.unbudgeted.get_or_insert_with(|| {
            self.env
                .payer(&self.b.tenant, self.b.key_id.as_deref())
                .is_none()
        })
    }

    /// Takes a held line's job into its target's group: to send, or sent
    /// by an earlier run (an attempt active).
    pub(super) async fn hold(
        &mut self,
        groups: &mut Groups,
        job: &JobRecord,
        p: &Planned,
    ) -> Result<(), StoreError> {
        let store = self.env.store().clone();
        let target = &p.route.targets[0];
        let i = match groups.0.iter().position(|g| {
            let t = &g.route.targets[0];
            t.provider.name == target.provider.name && t.model == target.model
        }) {
            Some(i) => i,
            None => {
                groups.0.push(Group {
                    route: p.route.clone(),
                    file: None,
                    to_send: Vec::new(),
                    resumed: Vec::new(),
                });
                groups.0.len() - 1
            }
        };
        let g = &mut groups.0[i];
        if !self.fresh {
            let attempts = store.attempts(&job.id).await?;
            if attempts.iter().any(|a| a.state.is_active()) {
                g.resumed.push(job.id.clone());
                return Ok(());
            }
        }
        let body = match crate::translate::prepare(
            Dialect::Chat,
            &p.request,
            &Forwarded::default(),
            target,
            &p.fp,
        ) {
            Ok(Prepared::Send(s)) => s.body,
            // Nothing to send upstream for it: the job workers run it.
            _ => {
                store.release_line(&job.id, now_ms()).await?;
                self.env.jobs().wake();
                return Ok(());
            }
        };
        let file = g.file.get_or_insert_with(|| {
            FileWriter::new(
                store.clone(),
                &self.b.tenant,
                format!("{}_upstream.jsonl", self.b.id),
                self.b.expires_at,
            )
            .purpose("batch_upstream")
        });
        let mut line = format!(
            "{{\"custom_id\":{},\"method\":\"POST\",\"url\":\"{CHAT}\",\"body\":",
            Value::String(job.id.clone())
        )
        .into_bytes();
        line.extend_from_slice(&body);
        line.push(b'}');
        file.line(&line).await?;
        g.to_send.push(job.id.clone());
        Ok(())
    }

    /// Sends each group's lines (unless an earlier run did), waits for its
    /// provider batch and completes the lines from it. Returns the lines
    /// handed to the job workers instead (their route and job id).
    pub(super) async fn send_upstream(
        &mut self,
        groups: Groups,
    ) -> Result<Vec<(Arc<Route>, String)>, StoreError> {
        let mut released = Vec::new();
        for g in groups.0 {
            released.extend(self.send_group(g).await?);
        }
        Ok(released)
    }

    async fn send_group(&mut self, g: Group) -> Result<Vec<(Arc<Route>, String)>, StoreError> {
        let store = self.env.store().clone();
        let route = g.route.clone();
        let target = &route.targets[0];
        let (provider, model) = (target.provider.name.to_string(), target.model.to_string());
        let mut released = Vec::new();
        let mut known = entries(&self.b);
        let at = known
            .iter()
            .position(|e| e.provider == provider && e.model == model);
        // The lines each attempt answers: job id -> (attempt, read version).
        let mut sent: HashMap<String, (i32, i64)> = HashMap::new();
        for id in &g.resumed {
            let attempts = store.attempts(id).await?;
            let Some(a) = attempts.iter().rev().find(|a| a.state.is_active()) else {
                continue;
            };
            match at.map(|i| &known[i]) {
                // Its call is the provider batch, which outlives this
                // process: an attempt made `unknown` meanwhile (its lease
                // ran out, the process restarted) is answered late by it.
                Some(e) if e.state == "sent" => {
                    sent.insert(id.clone(), (a.n, a.read_version));
                }
                // Already unknown: stays so, and no other attempt starts.
                _ if a.state == AttemptState::Unknown => {}
                _ => {
                    // Sent or not, nobody knows: unknown, as a timeout.
                    store
                        .finish_attempt(
                            id,
                            a.n,
                            AttemptState::Unknown,
                            Some("provider_batch_unknown"),
                            now_ms(),
                        )
                        .await?;
                }
            }
        }
        let mut batch_id = at.and_then(|i| known[i].batch.clone());
        if !g.to_send.is_empty() {
            let file = match g.file {
                Some(f) => f.finish().await?,
                None => None,
            };
            if at.is_some() || self.stopping.is_some() {
                // This target's provider batch was made by an earlier run
                // (or the batch is stopping): these lines go the usual way.
                for id in &g.to_send {
                    released.extend(self.give_back(id, &route).await?);
                }
                if let Some(file) = &file {
                    let _ = store.delete_file(&self.b.tenant, file).await;
                }
            } else if let Some(file) = file {
                known.push(Entry {
                    provider: provider.clone(),
                    model: model.clone(),
                    state: "sending".into(),
                    batch: None,
                });
                self.save_upstream(&known).await?;
                let lease = self.b.expires_at + LEASE_MARGIN_MS;
                for id in &g.to_send {
                    match store
                        .start_attempt(id, &provider, &model, false, &self.worker, now_ms(), lease)
                        .await?
                    {
                        StartAttempt::Started(a) => {
                            sent.insert(id.clone(), (a.n, a.read_version));
                        }
                        StartAttempt::Busy | StartAttempt::Closed => {}
                    }
                }
                match self.submit(&route, &file).await {
                    Ok(made) => {
                        let last = known.len() - 1;
                        known[last].state = "sent".into();
                        known[last].batch = Some(made.id.clone());
                        self.save_upstream(&known).await?;
                        batch_id = Some(made.id);
                    }
                    Err(e) => {
                        tracing::warn!(batch = %self.b.id, provider = %provider, error = %e, "provider batch not made");
                        // Refused, or the upload failed: the provider
                        // runs nothing, the job workers run the lines. The
                        // creation not reached: who knows.
                        let taken = matches!(e, BatchApiError::Transport(_));
                        for (id, (n, _)) in sent.drain() {
                            if taken {
                                store
                                    .finish_attempt(
                                        &id,
                                        n,
                                        AttemptState::Unknown,
                                        Some("provider_batch_unknown"),
                                        now_ms(),
                                    )
                                    .await?;
                            } else {
                                store
                                    .finish_attempt(
                                        &id,
                                        n,
                                        AttemptState::Failed,
                                        Some("provider_batch_refused"),
                                        now_ms(),
                                    )
                                    .await?;
                                released.extend(self.give_back(&id, &route).await?);
                            }
                        }
                    }
                }
                let _ = store.delete_file(&self.b.tenant, &file).await;
            }
        }
        if let Some(id) = batch_id
            && !sent.is_empty()
        {
            released.extend(self.collect(&route, &id, sent).await?);
        }
        Ok(released)
    }

    /// Uploads the lines' file and makes the provider batch of it.
    async fn submit(&self, route: &Route, file: &str) -> Result<ProviderBatch, BatchApiError> {
        let target = &route.targets[0];
        let Some((api, client)) = target.provider.batch_api() else {
            return Err(BatchApiError::Unreadable("no Batch API".into()));
        };
        let store = self.env.store().clone();
        let bytes = match store.file(&self.b.tenant, file).await {
            Ok(Some(f)) => u64::try_from(f.bytes).unwrap_or(0),
            _ => return Err(BatchApiError::Unreadable("the lines' file is gone".into())),
        };
        let (id, parts) = (file.to_string(), store.clone());
        let body = futures_util::stream::unfold(0i32, move |n| {
            let (id, parts) = (id.clone(), parts.clone());
            async move {
                match parts.file_part(&id, n).await {
                    Ok(Some(data)) => Some((Ok(Bytes::from(data)), n + 1)),
                    Ok(None) => None,
                    Err(e) => Some((Err(std::io::Error::other(e.to_string())), i32::MAX)),
                }
            }
        });
        // An upload that failed on the way made no batch: nothing runs.
        let uploaded = api
            .upload(client, format!("{}.jsonl", self.b.id), bytes, body)
            .await
            .map_err(|e| match e {
                BatchApiError::Transport(t) => BatchApiError::Unreadable(format!("upload: {t}")),
                other => other,
            })?;
        api.create(client, &uploaded, CHAT, json!({"idem_batch": self.b.id}))
            .await
    }

    /// Waits for provider batch `id` to end (asking it to cancel once if
    /// this batch stops meanwhile), then completes the lines it answered
    /// and hands the others on.
    async fn collect(
        &mut self,
        route: &Arc<Route>,
        id: &str,
        mut sent: HashMap<String, (i32, i64)>,
    ) -> Result<Vec<(Arc<Route>, String)>, StoreError> {
        let target = &route.targets[0];
        let Some((api, client)) = target.provider.batch_api() else {
            return Ok(Vec::new());
        };
        let mut released = Vec::new();
        let mut cancelled = false;
        let ended = loop {
            match api.get(client, id).await {
                Ok(b) if b.ended() => break b,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(batch = %self.b.id, upstream = %id, error = %e, "cannot read the provider batch")
                }
            }
            self.progress(false).await?;
            if self.stopping.is_some() && !cancelled {
                cancelled = true;
                if let Err(e) = api.cancel(client, id).await {
                    tracing::warn!(batch = %self.b.id, upstream = %id, error = %e, "cannot cancel the provider batch");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(api.poll) => {}
                () = self.stop.cancelled() => return Ok(released),
            }
        };
        let max_line = target.provider.max_answer_bytes.saturating_add(64 * 1024);
        for file in [&ended.output_file_id, &ended.error_file_id]
            .into_iter()
            .flatten()
        {
            let mut lines = match api.lines(client, file, max_line).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(batch = %self.b.id, upstream = %id, error = %e, "cannot read a provider batch's file");
                    continue;
                }
            };
            loop {
                let line = match lines.next().await {
                    Ok(Some(l)) => l,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(batch = %self.b.id, upstream = %id, error = %e, "a provider batch's file broke off");
                        break;
                    }
                };
                let Ok(out) = serde_json::from_slice::<OutLine<'_>>(&line) else {
                    continue;
                };
                let Some((n, read_version)) = sent.remove(&out.custom_id) else {
                    continue;
                };
                let answer = out
                    .response
                    .filter(|r| r.status_code == 200)
                    .map(|r| self.answer_of(route, r.body));
                released.extend(
                    self.settle(route, &out.custom_id, n, read_version, answer)
                        .await?,
                );
            }
        }
        // Lines the provider never answered (its batch failed, expired or
        // was cancelled).
        for (job, (n, _)) in sent {
            self.env
                .store()
                .finish_attempt(
                    &job,
                    n,
                    AttemptState::Failed,
                    Some("provider_batch_unanswered"),
                    now_ms(),
                )
                .await?;
            released.extend(self.give_back(&job, route).await?);
        }
        Ok(released)
    }

    /// A provider's answer to a line, checked as any answer of the route.
    fn answer_of(&self, route: &Route, body: &RawValue) -> Answer {
        let target = &route.targets[0];
        let mut answer = Answer {
            dialect: Dialect::Chat,
            status: reqwest::StatusCode::OK,
            form: Form::Plain,
            body: Bytes::copy_from_slice(body.get().as_bytes()),
            retry_after: None,
            failure: None,
            provider: target.provider.name.clone(),
            model: target.model.clone(),
            created_at: SystemTime::now(),
            upstream_latency: std::time::Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        };
        if let Some(why) = answer.malformed() {
            answer = answer.into_bad(&why);
        }
        if let Some(contract) = &route.contract {
            answer = crate::contracts::enforce(contract, &route.name, answer);
        }
        answer
    }

    /// Completes a sent line's job with the provider's answer, or ends its
    /// attempt `failed` and hands the line on.
    async fn settle(
        &mut self,
        route: &Arc<Route>,
        job: &str,
        n: i32,
        read_version: i64,
        answer: Option<Answer>,
    ) -> Result<Option<(Arc<Route>, String)>, StoreError> {
        let store = self.env.store().clone();
        match answer.filter(Answer::is_success) {
            Some(answer) => {
                let text = String::from_utf8_lossy(&answer.body).into_owned();
                if let Completion::Won(_) = store
                    .complete(job, n, read_version, &text, now_ms())
                    .await?
                {
                    let tenant: Arc<str> = Arc::from(self.b.tenant.as_str());
                    self.env.core().finish(Finish {
                        tenant: Some(&tenant),
                        route: Some(&route.name),
                        count: Some(Count::Answered(Outcome::Leader)),
                        priced: Some(route),
                        answered: Some(&answer),
                        ..Finish::default()
                    });
                }
                Ok(None)
            }
            None => {
                store
                    .finish_attempt(
                        job,
                        n,
                        AttemptState::Failed,
                        Some("provider_batch_failed"),
                        now_ms(),
                    )
                    .await?;
                self.give_back(job, route).await
            }
        }
    }

    /// A held line the provider did not answer: the job workers run it, or,
    /// when the batch is stopping, its job is cancelled.
    async fn give_back(
        &mut self,
        job: &str,
        route: &Arc<Route>,
    ) -> Result<Option<(Arc<Route>, String)>, StoreError> {
        let store = self.env.store().clone();
        if self.stopping.is_some() {
            store.cancel_job(&self.b.tenant, job, now_ms()).await?;
            return Ok(None);
        }
        if store.release_line(job, now_ms()).await? {
            self.env.jobs().wake();
        }
        Ok(Some((route.clone(), job.to_string())))
    }

    /// Writes the provider batches into the batch record (again after a
    /// cancel changed the record meanwhile).
    async fn save_upstream(&mut self, known: &[Entry]) -> Result<(), StoreError> {
        let text = serde_json::to_string(known).unwrap_or_default();
        for _ in 0..3 {
            let mut next = self.b.clone();
            next.upstream = Some(text.clone());
            if self.save(next).await? || self.stop.is_cancelled() {
                return Ok(());
            }
        }
        Ok(())
    }
}
