//! Row shapes shared by both backends, and their checked conversion into
//! the store's records: states are stored as text, so an unknown one is a
//! corrupt row rather than a panic.

use super::keys::current_period;
use super::{
    AttemptRecord, AttemptState, BudgetRecord, Certification, JobRecord, JobState, KeyRecord,
    StoreError,
};

/// A `jobs` row as the database returns it (`SELECT *` / `RETURNING *`).
#[derive(Debug)]
pub(super) struct JobRow {
    id: String,
    tenant: String,
    idempotency_key: String,
    payload_hash: String,
    fingerprint: String,
    route: String,
    request: String,
    dialect: String,
    forwarded: Option<String>,
    metadata: Option<String>,
    state: String,
    version: i64,
    completed_by: Option<i32>,
    result: Option<String>,
    error: Option<String>,
    not_before: i64,
    claimed_by: Option<String>,
    claim_until: Option<i64>,
    retries: i32,
    key_id: Option<String>,
    batch_id: Option<String>,
    created_at: i64,
    updated_at: i64,
}

from_row!(JobRow {
    id,
    tenant,
    idempotency_key,
    payload_hash,
    fingerprint,
    route,
    request,
    dialect,
    forwarded,
    metadata,
    state,
    version,
    completed_by,
    result,
    error,
    not_before,
    claimed_by,
    claim_until,
    retries,
    key_id,
    batch_id,
    created_at,
    updated_at
});

impl TryFrom<JobRow> for JobRecord {
    type Error = StoreError;

    fn try_from(r: JobRow) -> Result<Self, StoreError> {
        let state = JobState::parse(&r.state).ok_or_else(|| {
            StoreError::Corrupt(format!("job {}: unknown state {:?}", r.id, r.state))
        })?;
        Ok(JobRecord {
            id: r.id,
            tenant: r.tenant,
            idempotency_key: r.idempotency_key,
            payload_hash: r.payload_hash,
            fingerprint: r.fingerprint,
            route: r.route,
            request: r.request,
            dialect: r.dialect,
            forwarded: r.forwarded,
            metadata: r.metadata,
            state,
            version: r.version,
            completed_by: r.completed_by,
            result: r.result,
            error: r.error,
            not_before: r.not_before,
            claimed_by: r.claimed_by,
            claim_until: r.claim_until,
            retries: r.retries,
            key_id: r.key_id,
            batch_id: r.batch_id,
            created_at: r.created_at,
            updated_at: r.updated_at,
        })
    }
}

/// An `attempts` row.
#[derive(Debug)]
pub(super) struct AttemptRow {
    job_id: String,
    n: i32,
    provider: String,
    model: String,
    state: String,
    reason: Option<String>,
    hedge: bool,
    read_version: i64,
    owner: Option<String>,
    started_at: i64,
    finished_at: Option<i64>,
    lease_until: Option<i64>,
}

from_row!(AttemptRow {
    job_id,
    n,
    provider,
    model,
    state,
    reason,
    hedge,
    read_version,
    owner,
    started_at,
    finished_at,
    lease_until
});

impl TryFrom<AttemptRow> for AttemptRecord {
    type Error = StoreError;

    fn try_from(r: AttemptRow) -> Result<Self, StoreError> {
        let state = AttemptState::parse(&r.state).ok_or_else(|| {
            StoreError::Corrupt(format!(
                "attempt {}/{}: unknown state {:?}",
                r.job_id, r.n, r.state
            ))
        })?;
        Ok(AttemptRecord {
            job_id: r.job_id,
            n: r.n,
            provider: r.provider,
            model: r.model,
            state,
            reason: r.reason,
            hedge: r.hedge,
            read_version: r.read_version,
            owner: r.owner,
            started_at: r.started_at,
            finished_at: r.finished_at,
            lease_until: r.lease_until,
        })
    }
}

/// A `certifications` row (its surrogate `id` is only a tie-breaker).
#[derive(Debug)]
pub(super) struct CertificationRow {
    route: String,
    provider: String,
    model: String,
    contract_hash: String,
    passed: bool,
    failures: String,
    certified_at: i64,
}

from_row!(CertificationRow {
    route,
    provider,
    model,
    contract_hash,
    passed,
    failures,
    certified_at
});

impl From<CertificationRow> for Certification {
    fn from(r: CertificationRow) -> Self {
        Certification {
            route: r.route,
            provider: r.provider,
            model: r.model,
            contract_hash: r.contract_hash,
            passed: r.passed,
            failures: r.failures,
            certified_at: r.certified_at,
        }
    }
}

/// An `api_keys` row.
#[derive(Debug)]
pub(super) struct KeyRow {
    id: String,
    tenant: String,
    name: String,
    digest: String,
    hint: String,
    expires_at: Option<i64>,
    /// A JSON array of route names.
    models: Option<String>,
    rpm: Option<i64>,
    tpm: Option<i64>,
    budget_nanos: Option<i64>,
    budget_period: Option<String>,
    metadata: Option<String>,
    created_at: i64,
    revoked_at: Option<i64>,
    rotated_at: Option<i64>,
    last_used_at: Option<i64>,
    version: i64,
}

from_row!(KeyRow {
    id,
    tenant,
    name,
    digest,
    hint,
    expires_at,
    models,
    rpm,
    tpm,
    budget_nanos,
    budget_period,
    metadata,
    created_at,
    revoked_at,
    rotated_at,
    last_used_at,
    version
});

impl TryFrom<KeyRow> for KeyRecord {
    type Error = StoreError;

    fn try_from(r: KeyRow) -> Result<Self, StoreError> {
        let models = r
            .models
            .map(|text| serde_json::from_str::<Vec<String>>(&text))
            .transpose()
            .map_err(|e| StoreError::Corrupt(format!("key {}: models: {e}", r.id)))?;
        Ok(KeyRecord {
            id: r.id,
            tenant: r.tenant,
            name: r.name,
            digest: r.digest,
            hint: r.hint,
            expires_at: r.expires_at,
            models,
            rpm: r.rpm,
            tpm: r.tpm,
            budget_nanos: r.budget_nanos,
            budget_period: r.budget_period,
            metadata: r.metadata,
            created_at: r.created_at,
            revoked_at: r.revoked_at,
            rotated_at: r.rotated_at,
            last_used_at: r.last_used_at,
            version: r.version,
        })
    }
}

/// A key's `models` as the column stores them: a JSON array.
pub(super) fn models_text(models: Option<&[String]>) -> Option<String> {
    models.map(|m| serde_json::Value::from(m.to_vec()).to_string())
}

/// A `budgets` row with the sum of its live grants (`reserved_nanos`), as
/// stored: its period may have elapsed.
#[derive(Debug)]
pub(super) struct BudgetRow {
    scope: String,
    limit_nanos: Option<i64>,
    period_ms: Option<i64>,
    period_start: i64,
    spent_nanos: i64,
    total_nanos: i64,
    calls: i64,
    reserved_nanos: i64,
}

from_row!(BudgetRow {
    scope,
    limit_nanos,
    period_ms,
    period_start,
    spent_nanos,
    total_nanos,
    calls,
    reserved_nanos
});

impl BudgetRow {
    /// The budget as of `now` (its current period).
    pub(super) fn at(self, now: i64) -> BudgetRecord {
        let (period_start, spent_nanos) =
            current_period(self.period_ms, self.period_start, self.spent_nanos, now);
        BudgetRecord {
            scope: self.scope,
            limit_nanos: self.limit_nanos,
            period_ms: self.period_ms,
            period_start,
            spent_nanos,
            total_nanos: self.total_nanos,
            calls: self.calls,
            reserved_nanos: self.reserved_nanos,
        }
    }
}

/// Converts rows, failing on the first corrupt one.
pub(super) fn keys(rows: Vec<KeyRow>) -> Result<Vec<KeyRecord>, StoreError> {
    rows.into_iter().map(KeyRecord::try_from).collect()
}

/// Converts an optional row.
pub(super) fn key(row: Option<KeyRow>) -> Result<Option<KeyRecord>, StoreError> {
    row.map(KeyRecord::try_from).transpose()
}

/// Converts rows, failing on the first corrupt one.
pub(super) fn jobs(rows: Vec<JobRow>) -> Result<Vec<JobRecord>, StoreError> {
    rows.into_iter().map(JobRecord::try_from).collect()
}

/// Converts rows, failing on the first corrupt one.
pub(super) fn attempts(rows: Vec<AttemptRow>) -> Result<Vec<AttemptRecord>, StoreError> {
    rows.into_iter().map(AttemptRecord::try_from).collect()
}

/// Converts an optional row.
pub(super) fn job(row: Option<JobRow>) -> Result<Option<JobRecord>, StoreError> {
    row.map(JobRecord::try_from).transpose()
}

/// A job state read on its own (not as part of a whole row).
pub(super) fn job_state(job_id: &str, s: &str) -> Result<JobState, StoreError> {
    JobState::parse(s)
        .ok_or_else(|| StoreError::Corrupt(format!("job {job_id}: unknown state {s:?}")))
}

/// An attempt state read on its own.
pub(super) fn attempt_state(job_id: &str, n: i32, s: &str) -> Result<AttemptState, StoreError> {
    AttemptState::parse(s)
        .ok_or_else(|| StoreError::Corrupt(format!("attempt {job_id}/{n}: unknown state {s:?}")))
}

/// The states `finish_attempt` may move an attempt to: the ones that end it
/// without a result.
pub(super) fn is_finish_target(to: AttemptState) -> bool {
    matches!(
        to,
        AttemptState::Failed | AttemptState::Unknown | AttemptState::Cancelled
    )
}

/// `GROUP BY state` counts as one entry per job state, zeros included, so
/// that a state that empties is reported as 0 rather than vanishing.
pub(super) fn zero_filled_counts(
    rows: Vec<(String, i64)>,
) -> Result<Vec<(JobState, i64)>, StoreError> {
    let mut counts: Vec<(JobState, i64)> = JobState::ALL.iter().map(|s| (*s, 0)).collect();
    for (state, count) in rows {
        let state = JobState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("jobs: unknown state {state:?}")))?;
        if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == state) {
            slot.1 += count;
        }
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(state: &str) -> JobRow {
        JobRow {
            id: "j1".to_owned(),
            tenant: "t".to_owned(),
            idempotency_key: "k".to_owned(),
            payload_hash: "h".to_owned(),
            fingerprint: "f".to_owned(),
            route: "r".to_owned(),
            request: "{}".to_owned(),
            dialect: "chat".to_owned(),
            forwarded: None,
            metadata: None,
            state: state.to_owned(),
            version: 0,
            completed_by: None,
            result: None,
            error: None,
            not_before: 0,
            claimed_by: None,
            claim_until: None,
            retries: 0,
            key_id: None,
            batch_id: None,
            created_at: 0,
            updated_at: 0,
        }
    }

    #[test]
    fn unknown_states_are_corrupt_rows() {
        assert!(matches!(JobRecord::try_from(row("queued")), Ok(j) if j.state == JobState::Queued));
        assert!(
            matches!(JobRecord::try_from(row("exploded")), Err(StoreError::Corrupt(m)) if m.contains("exploded"))
        );
        assert!(matches!(
            attempt_state("j1", 1, "paused"),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            zero_filled_counts(vec![("paused".to_owned(), 1)]),
            Err(StoreError::Corrupt(_))
        ));
    }

    #[test]
    fn counts_cover_every_state() {
        let counts = zero_filled_counts(vec![("failed".to_owned(), 2)]).ok();
        let expected: Vec<(JobState, i64)> = JobState::ALL
            .iter()
            .map(|s| (*s, if *s == JobState::Failed { 2 } else { 0 }))
            .collect();
        assert_eq!(counts, Some(expected));
    }
}
