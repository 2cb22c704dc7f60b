//! TEMPORARY STUB (replaced by the real implementation on merge).
#![allow(clippy::too_many_arguments)]
use super::*;
use async_trait::async_trait;
pub struct SqliteStore;
fn stub() -> StoreError {
    StoreError::Corrupt("stub".into())
}
impl SqliteStore {
    pub async fn connect(_url: &str, _max: u32) -> Result<Self> {
        Ok(SqliteStore)
    }
}
#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> Backend {
        Backend::Sqlite
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }
    async fn create_job(&self, _job: &NewJob) -> Result<Created> {
        Err(stub())
    }
    async fn job(&self, _tenant: Option<&str>, _id: &str) -> Result<Option<JobRecord>> {
        Err(stub())
    }
    async fn job_by_key(&self, _tenant: &str, _key: &str) -> Result<Option<JobRecord>> {
        Err(stub())
    }
    async fn attempts(&self, _job_id: &str) -> Result<Vec<AttemptRecord>> {
        Err(stub())
    }
    async fn list_jobs(
        &self,
        _t: &str,
        _s: Option<JobState>,
        _b: Option<&Cursor>,
        _l: u32,
    ) -> Result<Vec<JobRecord>> {
        Err(stub())
    }
    async fn claim_jobs(&self, _w: &str, _n: i64, _c: i64, _l: u32) -> Result<Vec<JobRecord>> {
        Ok(vec![])
    }
    async fn renew_claim(&self, _j: &str, _w: &str, _c: i64) -> Result<bool> {
        Err(stub())
    }
    async fn requeue(
        &self,
        _j: &str,
        _w: Option<&str>,
        _nb: i64,
        _r: bool,
        _now: i64,
    ) -> Result<bool> {
        Err(stub())
    }
    async fn fail_job(&self, _j: &str, _e: &str, _now: i64) -> Result<bool> {
        Err(stub())
    }
    async fn start_attempt(
        &self,
        _j: &str,
        _p: &str,
        _m: &str,
        _h: bool,
        _o: &str,
        _now: i64,
        _l: i64,
    ) -> Result<StartAttempt> {
        Err(stub())
    }
    async fn attempt_running(&self, _j: &str, _n: i32) -> Result<bool> {
        Err(stub())
    }
    async fn renew_attempt(&self, _j: &str, _n: i32, _o: &str, _l: i64) -> Result<bool> {
        Err(stub())
    }
    async fn finish_attempt(
        &self,
        _j: &str,
        _n: i32,
        _to: AttemptState,
        _r: Option<&str>,
        _now: i64,
    ) -> Result<bool> {
        Err(stub())
    }
    async fn complete(
        &self,
        _j: &str,
        _n: i32,
        _v: i64,
        _r: &str,
        _now: i64,
    ) -> Result<Completion> {
        Err(stub())
    }
    async fn cancel_job(&self, _t: &str, _j: &str, _now: i64) -> Result<Option<JobRecord>> {
        Err(stub())
    }
    async fn expire_attempt_leases(&self, _now: i64) -> Result<Vec<AttemptRecord>> {
        Ok(vec![])
    }
    async fn expire_job_claims(&self, _now: i64) -> Result<u64> {
        Ok(0)
    }
    async fn unknown_attempts(&self) -> Result<Vec<AttemptRecord>> {
        Ok(vec![])
    }
    async fn count_jobs(&self, _t: Option<&str>) -> Result<Vec<(JobState, i64)>> {
        Ok(vec![])
    }
    async fn purge(&self, _b: i64) -> Result<u64> {
        Ok(0)
    }
    async fn record_certification(&self, _c: &Certification) -> Result<()> {
        Err(stub())
    }
    async fn certifications(&self, _r: &str) -> Result<Vec<Certification>> {
        Ok(vec![])
    }
}
