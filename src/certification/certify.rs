//! Certification: runs a route's golden cases against a target, directly
//! through the target's provider (no result cache, no coalescing: each run
//! must be a real answer), checks every answer against the contract and the
//! case's expectations, checks that each prompt fits the target's context
//! window where its tokenizer is known, and records the outcome in the store
//! (target, route, contract hash, passed, time, failures).
//!
//! `idem certify` prints [`Report::render_text`]; `POST /v1/admin/certify`
//! returns the same reports as JSON.

use std::fmt::Write as _;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::config::Config;
use crate::contracts::tokens::ModelLimits;
use crate::contracts::{Case, Contract, Violation};
use crate::dialect::Dialect;
use crate::providers::CallError;
use crate::routes::{Route, Routes, Target};
use crate::store::{Certification, Store, StoreError, now_ms};

/// Why a certification could not run (a failed certification is a
/// [`Report`], not an error).
#[derive(Debug, thiserror::Error)]
pub enum CertifyError {
    #[error("route `{0}` does not exist")]
    NoRoute(String),
    #[error("route `{0}` has no contract: there is nothing to certify")]
    NoContract(String),
    #[error("route `{route}` has no target `{target}` (its targets: {known})")]
    NoTarget {
        route: String,
        target: String,
        known: String,
    },
    #[error("route `{0}` has no failover targets; name the primary as the target to certify it")]
    NoFallbacks(String),
    #[error("cannot record the certification: {0}")]
    Store(#[from] StoreError),
}

/// One run of one case.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// 1-based.
    pub run: u32,
    pub passed: bool,
    /// The first contract violation (or failed expectation) of the answer.
    pub violation: Option<Violation>,
    /// Why there was no answer to check (the provider failed).
    pub error: Option<String>,
    /// Token counts the provider reported for this run.
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// One golden case on one target.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// 1-based, in file order.
    pub case: usize,
    pub name: Option<String>,
    /// The prompt's tokens by the target's tokenizer (None: unknown).
    pub prompt_tokens: Option<u32>,
    pub max_tokens: Option<u32>,
    /// Whether prompt + max_tokens fits the context window (None: not
    /// checked, the tokenizer or the window is unknown).
    pub fits: Option<bool>,
    pub passed: bool,
    /// Why the case failed before any run (the prompt does not fit).
    pub error: Option<String>,
    pub runs: Vec<RunReport>,
}

/// One failure, as stored with the certification.
#[derive(Debug, Clone, Serialize)]
pub struct FailureRecord {
    pub case: usize,
    pub run: Option<u32>,
    pub path: String,
    pub rule: String,
    pub message: String,
}

/// The certification of one target against one route's contract.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub object: &'static str,
    pub route: String,
    pub provider: String,
    pub model: String,
    /// True when this target is the route's primary.
    pub primary: bool,
    pub contract: String,
    pub contract_hash: String,
    pub passed: bool,
    pub certified_at: String,
    /// The target's tokenizer (None: unknown, prompt lengths not checked).
    pub tokenizer: Option<String>,
    pub context_window: Option<u32>,
    pub context_window_source: Option<&'static str>,
    pub runs_per_case: u32,
    pub temperature: f64,
    pub cases: Vec<CaseReport>,
    pub failures: Vec<FailureRecord>,
    #[serde(skip)]
    certified_at_ms: i64,
}

/// The targets to certify: the one named (`provider` or
/// `provider/model`), else every target but the primary.
pub fn select<'r>(route: &'r Route, target: Option<&str>) -> Result<Vec<&'r Target>, CertifyError> {
    match target {
        Some(name) => {
            let chosen: Vec<&Target> = route
                .targets
                .iter()
                .filter(|t| {
                    *t.provider.name == *name || format!("{}/{}", t.provider.name, t.model) == name
                })
                .collect();
            if chosen.is_empty() {
                let known: Vec<String> = route
                    .targets
                    .iter()
                    .map(|t| format!("{}/{}", t.provider.name, t.model))
                    .collect();
                return Err(CertifyError::NoTarget {
                    route: route.name.to_string(),
                    target: name.to_string(),
                    known: known.join(", "),
                });
            }
            Ok(chosen)
        }
        None => {
            let fallbacks: Vec<&Target> = route.targets.iter().skip(1).collect();
            if fallbacks.is_empty() {
                return Err(CertifyError::NoFallbacks(route.name.to_string()));
            }
            Ok(fallbacks)
        }
    }
}

/// Certifies the selected targets of `route_name` and records each report.
pub async fn certify(
    store: &dyn Store,
    config: &Config,
    routes: &Routes,
    route_name: &str,
    target: Option<&str>,
) -> Result<Vec<Report>, CertifyError> {
    let route = routes
        .get(route_name)
        .ok_or_else(|| CertifyError::NoRoute(route_name.to_string()))?;
    let contract = route
        .contract
        .clone()
        .ok_or_else(|| CertifyError::NoContract(route_name.to_string()))?;
    let mut reports = Vec::new();
    for t in select(&route, target)? {
        let report = certify_target(config, &route, &contract, t).await;
        record(store, &report).await?;
        tracing::info!(
            route = %route.name,
            provider = %t.provider.name,
            model = %t.model,
            contract = contract.short_hash(),
            passed = report.passed,
            "certification recorded"
        );
        reports.push(report);
    }
    Ok(reports)
}

/// Writes a report to the store.
pub async fn record(store: &dyn Store, report: &Report) -> Result<(), StoreError> {
    let failures = serde_json::to_string(&report.failures).unwrap_or_else(|_| "[]".into());
    store
        .record_certification(&Certification {
            route: report.route.clone(),
            provider: report.provider.clone(),
            model: report.model.clone(),
            contract_hash: report.contract_hash.clone(),
            passed: report.passed,
            failures,
            certified_at: report.certified_at_ms,
        })
        .await
}

/// Runs every case `runs_per_case` times against `target`.
pub async fn certify_target(
    config: &Config,
    route: &Route,
    contract: &Contract,
    target: &Target,
) -> Report {
    let target_window = route
        .config
        .targets
        .get(target.index)
        .and_then(|t| t.context_window);
    let provider_window = config
        .provider(&target.provider.name)
        .and_then(|p| p.context_window);
    let mut limits = ModelLimits::of(&target.model, target_window, provider_window);
    if limits.tokenizer.is_none() && target.provider.kind == crate::config::ProviderKind::Anthropic
    {
        // Anthropic's tokenizer is not public, but its API counts.
        limits.tokenizer = Some(PROVIDER_COUNT.into());
    }
    let mut cases = Vec::with_capacity(contract.cases.len());
    let mut failures = Vec::new();
    for case in &contract.cases {
        let report = certify_case(contract, target, &limits, case).await;
        if let Some(e) = &report.error {
            failures.push(FailureRecord {
                case: case.number,
                run: None,
                path: String::new(),
                rule: "context_window".into(),
                message: e.clone(),
            });
        }
        for run in &report.runs {
            if let Some(v) = &run.violation {
                failures.push(FailureRecord {
                    case: case.number,
                    run: Some(run.run),
                    path: v.path.clone(),
                    rule: v.rule.into(),
                    message: v.message.clone(),
                });
            } else if let Some(e) = &run.error {
                failures.push(FailureRecord {
                    case: case.number,
                    run: Some(run.run),
                    path: String::new(),
                    rule: "provider_error".into(),
                    message: e.clone(),
                });
            }
        }
        cases.push(report);
    }
    let at = now_ms();
    Report {
        object: "certification_report",
        route: route.name.to_string(),
        provider: target.provider.name.to_string(),
        model: target.model.to_string(),
        primary: target.index == 0,
        contract: contract.path.display().to_string(),
        contract_hash: contract.hash.clone(),
        passed: cases.iter().all(|c| c.passed),
        certified_at: crate::store::rfc3339(at),
        tokenizer: limits.tokenizer.clone(),
        context_window: limits.context_window,
        context_window_source: limits.window_source,
        runs_per_case: contract.runs_per_case,
        temperature: contract.temperature,
        cases,
        failures,
        certified_at_ms: at,
    }
}

async fn certify_case(
    contract: &Contract,
    target: &Target,
    limits: &ModelLimits,
    case: &Case,
) -> CaseReport {
    let prompt_tokens = match limits.count(&target.model, &case.messages) {
        Some(n) => Some(n),
        // No tokenizer here: the provider's own count, where its API has one.
        None if limits.tokenizer.as_deref() == Some(PROVIDER_COUNT) => {
            match provider_count(target, &case.messages).await {
                Some(Ok(n)) => Some(n),
                Some(Err(e)) => {
                    tracing::warn!(provider = %target.provider.name, error = %e, "cannot count a case's tokens");
                    None
                }
                None => None,
            }
        }
        None => None,
    };
    let fits = match (prompt_tokens, limits.context_window) {
        (Some(p), Some(w)) => {
            Some(u64::from(p) + u64::from(case.max_tokens.unwrap_or(0)) <= u64::from(w))
        }
        _ => None,
    };
    let mut report = CaseReport {
        case: case.number,
        name: case.name.clone(),
        prompt_tokens,
        max_tokens: case.max_tokens,
        fits,
        passed: true,
        error: None,
        runs: Vec::new(),
    };
    if fits == Some(false) {
        let (p, m) = (prompt_tokens.unwrap_or(0), case.max_tokens.unwrap_or(0));
        report.passed = false;
        report.error = Some(format!(
            "the prompt is {p} tokens + max_tokens {m} = {} tokens, above the context window of \
             {} tokens of {} ({} tokenizer): not sent",
            u64::from(p) + u64::from(m),
            limits.context_window.unwrap_or(0),
            target.model,
            limits.tokenizer.as_deref().unwrap_or("?"),
        ));
        return report;
    }
    for run in 1..=contract.runs_per_case {
        let r = run_once(contract, target, case, run).await;
        report.passed &= r.passed;
        report.runs.push(r);
    }
    report
}

/// One certification call, straight to the provider.
async fn run_once(contract: &Contract, target: &Target, case: &Case, run: u32) -> RunReport {
    let mut report = RunReport {
        run,
        passed: false,
        violation: None,
        error: None,
        prompt_tokens: None,
        completion_tokens: None,
    };
    let mut body = Map::new();
    body.insert("model".into(), Value::String(target.model.to_string()));
    body.insert("messages".into(), Value::Array(case.messages.clone()));
    body.insert("temperature".into(), json!(contract.temperature));
    if let Some(m) = case.max_tokens {
        body.insert("max_tokens".into(), json!(m));
    }
    let body = Bytes::from(Value::Object(body).to_string());
    let completion = match call(target, body).await {
        Ok(c) => c,
        Err(e) => {
            report.error = Some(e);
            return report;
        }
    };
    report.prompt_tokens = completion
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64);
    report.completion_tokens = completion
        .pointer("/usage/completion_tokens")
        .and_then(Value::as_u64);
    let checked = match completion
        .pointer("/choices/0/message/content")
        .and_then(Value::as_str)
    {
        None => Err(Violation::new(
            "",
            "no_content",
            "the answer has no assistant text content",
        )),
        Some(content) => contract
            .check_completion(&completion)
            .and_then(|()| contract.check_case(case, content)),
    };
    match checked {
        Ok(()) => report.passed = true,
        Err(v) => report.violation = Some(v),
    }
    report
}

/// The tokenizer a report names when the provider's API counted.
const PROVIDER_COUNT: &str = "the provider's count_tokens";

/// A chat request's prompt tokens as the target's own API counts them
/// (Anthropic's count_tokens, sent the request as the Messages API says
/// it): `None` when its API has no count.
async fn provider_count(target: &Target, messages: &[Value]) -> Option<Result<u32, String>> {
    if !target.provider.speaks(Dialect::CountTokens) {
        return None;
    }
    let mut chat = Map::new();
    chat.insert("model".into(), Value::String(target.model.to_string()));
    chat.insert("messages".into(), Value::Array(messages.to_vec()));
    let (mut request, _) = match crate::translate::chat_messages::request::translate(&chat, 1) {
        Ok(t) => t,
        Err(e) => return Some(Err(e.to_string())),
    };
    request.retain(|k, _| matches!(k.as_str(), "model" | "system" | "messages" | "tools"));
    let body = Bytes::from(Value::Object(request).to_string());
    let answer = exchange(target, Dialect::CountTokens, body).await;
    Some(answer.and_then(|v| {
        v.get("input_tokens")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| "the token count's answer has no input_tokens".to_string())
    }))
}

/// Sends one chat request (translated for a target of another dialect)
/// and reads the whole answer as a chat completion.
async fn call(target: &Target, body: Bytes) -> Result<Value, String> {
    let chat: Map<String, Value> =
        serde_json::from_slice(&body).map_err(|e| format!("the case is not a request: {e}"))?;
    let fp = crate::fingerprint::Fingerprint::from_bytes([0; 32]);
    let sendable = match crate::translate::prepare(
        Dialect::Chat,
        &chat,
        &crate::fingerprint::NO_HEADERS,
        target,
        &fp,
    ) {
        Ok(crate::translate::Prepared::Send(s)) => s,
        Ok(crate::translate::Prepared::Local(body)) => {
            return serde_json::from_slice(&body).map_err(|e| e.to_string());
        }
        Err(e) => return Err(e.to_string()),
    };
    let provider = &target.provider;
    let reply = provider
        .send(
            sendable.dialect,
            &target.model,
            sendable.body,
            &sendable.forwarded,
            provider.timeout,
            None,
        )
        .await
        .map_err(|e| describe(&e))?;
    let reply = match sendable.reply {
        Some(t) => crate::translate::translated(reply, t, provider.max_answer_bytes),
        None => reply,
    };
    read_whole(target, reply).await
}

/// Sends `body` in `dialect`, as it is, and reads the whole answer.
async fn exchange(target: &Target, dialect: Dialect, body: Bytes) -> Result<Value, String> {
    let provider = &target.provider;
    let reply = provider
        .send(
            dialect,
            &target.model,
            body,
            &crate::fingerprint::NO_HEADERS,
            provider.timeout,
            None,
        )
        .await
        .map_err(|e| describe(&e))?;
    read_whole(target, reply).await
}

/// A reply read whole (within the provider's `max_answer_bytes`) as JSON;
/// an error status is an error.
async fn read_whole(
    target: &Target,
    reply: crate::providers::UpstreamReply,
) -> Result<Value, String> {
    let provider = &target.provider;
    let mut whole = BytesMut::new();
    let mut stream = reply.body;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| describe(&e))?;
        if whole.len() + chunk.len() > provider.max_answer_bytes {
            return Err(format!(
                "the answer is larger than the provider's max_answer_bytes ({})",
                provider.max_answer_bytes
            ));
        }
        whole.extend_from_slice(&chunk);
    }
    if !reply.status.is_success() {
        return Err(format!(
            "the provider answered HTTP {}",
            reply.status.as_u16()
        ));
    }
    let parsed = if reply.streaming {
        crate::sse::assemble(&whole).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice::<Value>(&whole).map_err(|e| e.to_string())
    };
    parsed.map_err(|e| format!("the provider's answer is not a chat completion: {e}"))
}

/// What went wrong with a call, without addresses.
fn describe(e: &CallError) -> String {
    match e {
        CallError::Connect { provider, .. } => format!("provider {provider} is unreachable"),
        CallError::Timeout { provider, after } => {
            format!("provider {provider} did not answer within {after:?}")
        }
        CallError::Broken { provider, .. } => {
            format!("the connection to provider {provider} was lost")
        }
        CallError::Untranslatable { .. } => e.to_string(),
    }
}

impl Report {
    /// The human-readable report `idem certify` prints.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let role = if self.primary { " (primary)" } else { "" };
        let _ = writeln!(
            out,
            "certify route {} -> {}/{}{role}",
            self.route, self.provider, self.model
        );
        let _ = writeln!(
            out,
            "  contract  {} ({})",
            self.contract,
            crate::contracts::short_hash(&self.contract_hash)
        );
        let _ = writeln!(
            out,
            "  runs      {} per case at temperature {}",
            self.runs_per_case, self.temperature
        );
        match (&self.tokenizer, self.context_window) {
            (Some(t), Some(w)) => {
                let src = self.context_window_source.unwrap_or("?");
                let _ = writeln!(out, "  tokens    {t} tokenizer, context window {w} ({src})");
            }
            (Some(t), None) => {
                let _ = writeln!(
                    out,
                    "  tokens    {t} tokenizer, context window unknown: prompt length not checked"
                );
            }
            (None, _) => {
                let _ = writeln!(
                    out,
                    "  tokens    tokenizer unknown for {}: prompt length not checked (not failed)",
                    self.model
                );
            }
        }
        for c in &self.cases {
            let name = c
                .name
                .as_deref()
                .map(|n| format!(" \"{n}\""))
                .unwrap_or_default();
            let tokens = match (c.prompt_tokens, c.fits) {
                (Some(p), Some(true)) => format!(
                    "prompt {p} tokens + max_tokens {}: fits",
                    c.max_tokens.unwrap_or(0)
                ),
                (Some(p), Some(false)) => format!(
                    "prompt {p} tokens + max_tokens {}: does NOT fit",
                    c.max_tokens.unwrap_or(0)
                ),
                (Some(p), None) => format!("prompt {p} tokens"),
                (None, _) => "prompt tokens not counted".into(),
            };
            let verdict = if c.passed { "PASS" } else { "FAIL" };
            let _ = writeln!(out, "  case {}{name}: {verdict} ({tokens})", c.case);
            if let Some(e) = &c.error {
                let _ = writeln!(out, "    {e}");
            }
            for r in &c.runs {
                let usage = match (r.prompt_tokens, r.completion_tokens) {
                    (Some(p), Some(o)) => format!(" [{p} prompt + {o} completion tokens]"),
                    _ => String::new(),
                };
                let line = match (&r.violation, &r.error) {
                    (Some(v), _) => format!("FAIL at {v}"),
                    (None, Some(e)) => format!("FAIL: {e}"),
                    (None, None) => "ok".into(),
                };
                let _ = writeln!(
                    out,
                    "    run {}/{}: {line}{usage}",
                    r.run, self.runs_per_case
                );
            }
        }
        let runs: usize = self.cases.iter().map(|c| c.runs.len()).sum();
        let failed = self.failures.len();
        let _ = writeln!(
            out,
            "  result    {} ({failed} failure(s) in {runs} run(s) of {} case(s)); recorded",
            if self.passed { "CERTIFIED" } else { "FAILED" },
            self.cases.len()
        );
        out
    }
}
