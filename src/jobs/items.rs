//! An embeddings job's attempt: its request cut into items as the
//! embeddings face cuts it, each item its own flight and cache entry on
//! the attempt's target, so an item shares its call with the same item of
//! a live request or another job, and the items this attempt leads share
//! one call.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::answer::Answer;
use crate::budgets::Payer;
use crate::endpoints::embeddings::{self as wire, EMBEDDINGS};
use crate::fingerprint;
use crate::flight::{FlightError, RequestBody};
use crate::outcome::Outcome;
use crate::routes::{Route, Target};
use crate::task::{AttemptRules, CachePolicy, Core, Task};
use crate::telemetry::Trace;

/// What an embeddings attempt embeds, and for whom.
pub(super) struct Embed<'a> {
    pub tenant: &'a Arc<str>,
    pub route: &'a Arc<Route>,
    pub request: &'a Map<String, Value>,
    pub trace: Option<&'a Trace>,
    pub payer: Option<&'a Payer>,
}

/// The attempt's answer to the whole request, and how it was obtained
/// (`leader` when anything was sent). An item answered from the cache by
/// another target than the attempt's is asked again without the cache:
/// the attempt row names its target.
pub(super) async fn attempt(
    core: &Core,
    e: Embed<'_>,
    target: &Target,
    rules: AttemptRules,
) -> Result<(Outcome, Answer), FlightError> {
    // Checked when the job was made: a stored request that no longer
    // parses is a bug.
    let req = wire::parse(e.request.clone()).map_err(|_| FlightError::BodyLost)?;
    let fp_rules = e.route.rules(e.tenant);
    let bodies: Vec<(RequestBody, fingerprint::Fingerprint)> = req
        .items
        .into_iter()
        .map(|item| {
            let fp = fingerprint::fingerprint(&item, None, &fp_rules);
            (RequestBody::kept(Arc::new(item)), fp)
        })
        .collect();
    let tasks: Vec<Task<'_>> = bodies
        .iter()
        .map(|(body, fp)| Task {
            tenant: e.tenant,
            route: e.route,
            fp: *fp,
            body,
            wire: &EMBEDDINGS,
            policy: CachePolicy::default(),
            trace: e.trace,
            payer: e.payer,
        })
        .collect();
    let mut items: Vec<Option<(Outcome, Arc<Answer>)>> = vec![None; tasks.len()];
    let mut asked: Vec<usize> = (0..tasks.len()).collect();
    let mut rules = rules;
    loop {
        let round: Vec<Task<'_>> = asked.iter().map(|&i| tasks[i]).collect();
        let delivered = core.attempt_items(&round, target, rules).await;
        let mut again = Vec::new();
        for (&i, d) in asked.iter().zip(delivered) {
            let d = d?;
            let answer = d.answer().await;
            if rules.read_cache
                && answer.is_success()
                && (answer.provider != target.provider.name || answer.model != target.model)
            {
                again.push(i);
            }
            items[i] = Some((d.outcome, answer));
        }
        if again.is_empty() {
            break;
        }
        asked = again;
        rules.read_cache = false;
    }
    let items: Vec<(Outcome, Arc<Answer>)> = items.into_iter().flatten().collect();
    let outcome = wire::outcome_of(items.iter().map(|(o, _)| *o));
    Ok((outcome, wire::whole(&items, req.encoding)))
}
