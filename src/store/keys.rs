//! The records of virtual keys and budgets kept in the database: the keys
//! themselves, the audit log of their changes, and each spender's budget
//! with what gateway processes have reserved of it.
//!
//! Money is nano-dollars (1 dollar = 1e9), times are milliseconds since
//! the Unix epoch, as everywhere in the store.
//!
//! A budget is spent in two steps. A gateway process (a holder) first
//! reserves with [`Store::grant`](super::Store::grant): in one transaction
//! that holds the budget row, the grant succeeds only if what is left
//! (`limit - spent - every live grant`) covers it, so holders racing,
//! whatever their connections or processes, are never granted more
//! together than the budget has left. When the call's cost is known it is
//! settled with [`Store::settle`](super::Store::settle): spent goes up by
//! the real cost and the holder's grant down by what the call reserved.
//! Grants are leased: a holder renews its leases while it runs, and the
//! grants of a holder that stopped renewing no longer count for others.

/// A virtual key (an `api_keys` row). The secret is never stored, only its
/// digest.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRecord {
    /// `key_<uuid v7>`, chosen by the caller; it never changes, rotations
    /// included.
    pub id: String,
    pub tenant: String,
    pub name: String,
    /// Hex SHA-256 of the secret; unique among all keys.
    pub digest: String,
    /// What a listing shows of the secret (`sk-idem-...a1b2`).
    pub hint: String,
    /// None: never expires.
    pub expires_at: Option<i64>,
    /// The routes the key may use; None: every route.
    pub models: Option<Vec<String>>,
    /// Requests per minute; None: no limit.
    pub rpm: Option<i64>,
    /// Tokens per minute; None: no limit.
    pub tpm: Option<i64>,
    /// The key's budget in nano-dollars; None: no budget.
    pub budget_nanos: Option<i64>,
    /// `1d`, `7d` or `30d` (see [`period_ms`]); None: the budget never
    /// resets.
    pub budget_period: Option<String>,
    /// Client metadata, as a JSON object.
    pub metadata: Option<String>,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
    pub rotated_at: Option<i64>,
    /// Written in batches by [`Store::touch_keys`](super::Store::touch_keys),
    /// which changes no version.
    pub last_used_at: Option<i64>,
    /// 1 when created, 1 more with every change.
    pub version: i64,
}

/// A change to a key: `None` leaves a field, `Some(None)` clears it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyChange {
    pub name: Option<String>,
    pub expires_at: Option<Option<i64>>,
    pub models: Option<Option<Vec<String>>>,
    pub rpm: Option<Option<i64>>,
    pub tpm: Option<Option<i64>>,
    pub budget_nanos: Option<Option<i64>>,
    pub budget_period: Option<Option<String>>,
    pub metadata: Option<Option<String>>,
}

/// A `key_audit` row: who did what to a key, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub at: i64,
    /// Who made the change (an admin key's name, `config`, ...).
    pub actor: String,
    /// `create`, `update`, `revoke` or `rotate`.
    pub action: String,
    pub key_id: String,
    pub tenant: String,
    /// What changed, as a JSON object.
    pub detail: String,
}

from_row!(AuditEntry {
    at,
    actor,
    action,
    key_id,
    tenant,
    detail
});

/// A spender's budget (a `budgets` row) as of a given time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetRecord {
    /// `key:<id>` or `tenant:<name>`.
    pub scope: String,
    /// None: no limit (spend is still counted).
    pub limit_nanos: Option<i64>,
    /// None: the period never ends.
    pub period_ms: Option<i64>,
    /// When the current period began.
    pub period_start: i64,
    /// Spent in the current period.
    pub spent_nanos: i64,
    /// Spent in all.
    pub total_nanos: i64,
    /// Calls settled, in all.
    pub calls: i64,
    /// The sum of live grants (lease_until > now) of every holder.
    pub reserved_nanos: i64,
}

/// Calls settled against one spender: what they had reserved (taken off
/// the holder's grant), what they cost, how many.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settlement {
    /// `key:<id>` or `tenant:<name>`.
    pub scope: String,
    pub reserved: i64,
    pub spent: i64,
    pub calls: i64,
}

/// The length of a key's budget period: `1d`, `7d` or `30d` in
/// milliseconds; None for anything else.
pub fn period_ms(text: &str) -> Option<i64> {
    const DAY: i64 = 86_400_000;
    match text {
        "1d" => Some(DAY),
        "7d" => Some(7 * DAY),
        "30d" => Some(30 * DAY),
        _ => None,
    }
}

/// The current period of a budget at `now`: when its period (if any, and
/// positive) has elapsed, `period_start` moves on by whole periods to the
/// one `now` is in and the period's spend starts again from 0. Returns the
/// period's start and spend.
pub(super) fn current_period(
    period_ms: Option<i64>,
    period_start: i64,
    spent_nanos: i64,
    now: i64,
) -> (i64, i64) {
    match period_ms {
        Some(p) if p > 0 && now >= period_start.saturating_add(p) => {
            let whole = now.saturating_sub(period_start) / p;
            (period_start.saturating_add(whole.saturating_mul(p)), 0)
        }
        _ => (period_start, spent_nanos),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_are_whole_days() {
        assert_eq!(period_ms("1d"), Some(86_400_000));
        assert_eq!(period_ms("7d"), Some(604_800_000));
        assert_eq!(period_ms("30d"), Some(2_592_000_000));
        for other in ["", "1h", "1D", "30d ", "month"] {
            assert_eq!(period_ms(other), None, "{other:?}");
        }
    }

    #[test]
    fn a_period_moves_on_by_whole_periods() {
        // Not elapsed, or no period: unchanged.
        assert_eq!(current_period(Some(10), 100, 7, 109), (100, 7));
        assert_eq!(current_period(None, 100, 7, 1_000_000), (100, 7));
        assert_eq!(current_period(Some(0), 100, 7, 1_000_000), (100, 7));
        // Elapsed: the start of the period `now` is in, spend from 0.
        assert_eq!(current_period(Some(10), 100, 7, 110), (110, 0));
        assert_eq!(current_period(Some(10), 100, 7, 135), (130, 0));
        // No overflow at the far ends.
        assert_eq!(current_period(Some(1), i64::MIN, 7, i64::MAX).1, 0);
    }
}
