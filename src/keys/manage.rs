//! Managing the store's keys: create, change, revoke, rotate, each with
//! its audit row, and a key's view with its budget. The admin API and
//! `idem keys` are two faces on these functions; both describe a key with
//! the same JSON fields (docs/http-api.md, "Keys").

use serde_json::{Map, Value, json};

use super::new_secret;
use crate::prices::dollars;
use crate::store::{
    AuditEntry, BudgetRecord, KeyChange, KeyRecord, Store, StoreError, now_ms, period_ms, rfc3339,
};

/// Why a key could not be managed.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("`{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("no key {0}")]
    NotFound(String),
    #[error("key {0} is revoked: it cannot be rotated")]
    Revoked(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn invalid(field: &'static str, message: impl Into<String>) -> KeyError {
    KeyError::Invalid {
        field,
        message: message.into(),
    }
}

/// The fields a key's JSON may set, read from an object: absent leaves a
/// field, `null` clears it.
struct Fields {
    change: KeyChange,
}

const FIELDS: &[&str] = &[
    "tenant",
    "name",
    "expires_at",
    "expires_in",
    "models",
    "rpm",
    "tpm",
    "budget_usd",
    "budget_period",
    "metadata",
];

fn read(spec: &Map<String, Value>) -> Result<Fields, KeyError> {
    if let Some(unknown) = spec.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(KeyError::Invalid {
            field: "key",
            message: format!("unknown field `{unknown}`; known: {}", FIELDS.join(", ")),
        });
    }
    let mut c = KeyChange::default();
    if let Some(v) = spec.get("name") {
        let name = v
            .as_str()
            .filter(|n| !n.trim().is_empty() && n.len() <= 200)
            .ok_or_else(|| invalid("name", "expected a name of 1..200 characters"))?;
        c.name = Some(name.to_string());
    }
    match (spec.get("expires_at"), spec.get("expires_in")) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "expires_in",
                "give expires_at or expires_in, not both",
            ));
        }
        (Some(Value::Null), None) | (None, Some(Value::Null)) => c.expires_at = Some(None),
        (Some(v), None) => {
            let t = v
                .as_str()
                .and_then(|s| humantime::parse_rfc3339_weak(s).ok())
                .ok_or_else(|| invalid("expires_at", "expected an RFC 3339 time"))?;
            let ms = t
                .duration_since(std::time::UNIX_EPOCH)
                .map_err(|_| invalid("expires_at", "expected a time after 1970"))?
                .as_millis();
            c.expires_at = Some(Some(i64::try_from(ms).unwrap_or(i64::MAX)));
        }
        (None, Some(v)) => {
            let d = v
                .as_str()
                .and_then(|s| humantime::parse_duration(s).ok())
                .ok_or_else(|| invalid("expires_in", "expected a duration such as 30d or 12h"))?;
            let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
            c.expires_at = Some(Some(now_ms().saturating_add(ms)));
        }
        (None, None) => {}
    }
    if let Some(v) = spec.get("models") {
        c.models = Some(match v {
            Value::Null => None,
            Value::Array(a) => Some(
                a.iter()
                    .map(|m| m.as_str().filter(|m| !m.is_empty()).map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| invalid("models", "expected model names"))?,
            ),
            _ => {
                return Err(invalid(
                    "models",
                    "expected an array of model names, or null",
                ));
            }
        });
    }
    for (field, slot) in [("rpm", &mut c.rpm), ("tpm", &mut c.tpm)] {
        if let Some(v) = spec.get(field) {
            *slot = Some(match v {
                Value::Null => None,
                v => Some(v.as_i64().filter(|n| *n > 0).ok_or_else(|| {
                    invalid(
                        field_name(field),
                        "expected a positive whole number, or null",
                    )
                })?),
            });
        }
    }
    if let Some(v) = spec.get("budget_usd") {
        c.budget_nanos = Some(match v {
            Value::Null => None,
            v => {
                let usd = v
                    .as_f64()
                    .filter(|d| d.is_finite() && *d >= 0.0 && *d < 1e9)
                    .ok_or_else(|| {
                        invalid("budget_usd", "expected dollars, zero or more, or null")
                    })?;
                Some(i64::try_from(crate::prices::nanos(usd)).unwrap_or(i64::MAX))
            }
        });
    }
    if let Some(v) = spec.get("budget_period") {
        c.budget_period = Some(match v {
            Value::Null => None,
            v => {
                let p = v
                    .as_str()
                    .filter(|p| period_ms(p).is_some())
                    .ok_or_else(|| invalid("budget_period", "expected 1d, 7d or 30d, or null"))?;
                Some(p.to_string())
            }
        });
    }
    if let Some(v) = spec.get("metadata") {
        c.metadata = Some(match v {
            Value::Null => None,
            Value::Object(_) => Some(v.to_string()),
            _ => return Err(invalid("metadata", "expected an object, or null")),
        });
    }
    Ok(Fields { change: c })
}

fn field_name(f: &str) -> &'static str {
    if f == "rpm" { "rpm" } else { "tpm" }
}

/// A new key of `spec` (`tenant` and `name` required): its row and the
/// secret, which is shown this once.
pub async fn create(
    store: &dyn Store,
    spec: &Map<String, Value>,
    actor: &str,
) -> Result<(KeyRecord, String), KeyError> {
    let tenant = spec
        .get("tenant")
        .and_then(Value::as_str)
        .filter(|t| crate::config::valid_name(t))
        .ok_or_else(|| invalid("tenant", crate::config::NAME_RULE))?
        .to_string();
    let Fields { change: c } = read(spec)?;
    let name = c
        .name
        .clone()
        .ok_or_else(|| invalid("name", "a key needs a name"))?;
    if c.budget_period.clone().flatten().is_some() && c.budget_nanos.flatten().is_none() {
        return Err(invalid("budget_period", "a period needs a budget_usd"));
    }
    let secret = new_secret();
    let now = now_ms();
    let key = KeyRecord {
        id: format!("key_{}", uuid::Uuid::now_v7().simple()),
        tenant,
        name,
        digest: secret.digest,
        hint: secret.hint,
        expires_at: c.expires_at.flatten(),
        models: c.models.clone().flatten(),
        rpm: c.rpm.flatten(),
        tpm: c.tpm.flatten(),
        budget_nanos: c.budget_nanos.flatten(),
        budget_period: c.budget_period.clone().flatten(),
        metadata: c.metadata.clone().flatten(),
        created_at: now,
        revoked_at: None,
        rotated_at: None,
        last_used_at: None,
        version: 1,
    };
    let audit = AuditEntry {
        at: now,
        actor: actor.to_string(),
        action: "create".into(),
        key_id: key.id.clone(),
        tenant: key.tenant.clone(),
        detail: Value::Object(spec.clone()).to_string(),
    };
    store.create_key(&key, &audit).await?;
    Ok((key, secret.plain))
}

/// Changes key `id` as `spec` says (its tenant cannot change).
pub async fn update(
    store: &dyn Store,
    id: &str,
    spec: &Map<String, Value>,
    actor: &str,
) -> Result<KeyRecord, KeyError> {
    if spec.contains_key("tenant") {
        return Err(invalid(
            "tenant",
            "a key's tenant cannot change: make a new key",
        ));
    }
    let before = store
        .key(id)
        .await?
        .ok_or_else(|| KeyError::NotFound(id.into()))?;
    let Fields { change } = read(spec)?;
    let period = change
        .budget_period
        .clone()
        .unwrap_or(before.budget_period.clone());
    let budget = change.budget_nanos.unwrap_or(before.budget_nanos);
    if period.is_some() && budget.is_none() {
        return Err(invalid("budget_period", "a period needs a budget_usd"));
    }
    let audit = AuditEntry {
        at: now_ms(),
        actor: actor.to_string(),
        action: "update".into(),
        key_id: id.to_string(),
        tenant: before.tenant.clone(),
        detail: Value::Object(spec.clone()).to_string(),
    };
    store
        .update_key(id, &change, &audit)
        .await?
        .ok_or_else(|| KeyError::NotFound(id.into()))
}

/// Revokes key `id`: from the next refresh on, no replica admits it.
pub async fn revoke(store: &dyn Store, id: &str, actor: &str) -> Result<KeyRecord, KeyError> {
    let before = store
        .key(id)
        .await?
        .ok_or_else(|| KeyError::NotFound(id.into()))?;
    let now = now_ms();
    let audit = AuditEntry {
        at: now,
        actor: actor.to_string(),
        action: "revoke".into(),
        key_id: id.to_string(),
        tenant: before.tenant,
        detail: "{}".into(),
    };
    store
        .revoke_key(id, now, &audit)
        .await?
        .ok_or_else(|| KeyError::NotFound(id.into()))
}

/// A new secret for key `id`, which keeps its id, spend, budget and
/// history; the old secret stops working at the next refresh.
pub async fn rotate(
    store: &dyn Store,
    id: &str,
    actor: &str,
) -> Result<(KeyRecord, String), KeyError> {
    let before = store
        .key(id)
        .await?
        .ok_or_else(|| KeyError::NotFound(id.into()))?;
    if before.revoked_at.is_some() {
        return Err(KeyError::Revoked(id.into()));
    }
    let secret = new_secret();
    let now = now_ms();
    let audit = AuditEntry {
        at: now,
        actor: actor.to_string(),
        action: "rotate".into(),
        key_id: id.to_string(),
        tenant: before.tenant,
        detail: json!({"hint": secret.hint}).to_string(),
    };
    let key = store
        .rotate_key(id, &secret.digest, &secret.hint, now, &audit)
        .await?
        .ok_or_else(|| KeyError::Revoked(id.into()))?;
    Ok((key, secret.plain))
}

/// A key's JSON: its fields, its state and its budget (none: no row
/// yet). Never its secret or digest.
pub fn view(key: &KeyRecord, budget: Option<&BudgetRecord>, now: i64) -> Value {
    let state = if key.revoked_at.is_some() {
        "revoked"
    } else if key.expires_at.is_some_and(|t| t <= now) {
        "expired"
    } else {
        "active"
    };
    let time = |t: Option<i64>| t.map(rfc3339);
    json!({
        "object": "api_key",
        "id": key.id,
        "tenant": key.tenant,
        "name": key.name,
        "hint": key.hint,
        "state": state,
        "created_at": rfc3339(key.created_at),
        "expires_at": time(key.expires_at),
        "revoked_at": time(key.revoked_at),
        "rotated_at": time(key.rotated_at),
        "last_used_at": time(key.last_used_at),
        "models": key.models,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "budget": budget_view(budget, key.budget_nanos, key.budget_period.as_deref()),
        "metadata": key.metadata.as_deref().and_then(|m| serde_json::from_str::<Value>(m).ok()),
    })
}

/// A spender's budget and spend, in dollars.
pub fn budget_view(row: Option<&BudgetRecord>, limit: Option<i64>, period: Option<&str>) -> Value {
    let spent = row.map_or(0, |b| b.spent_nanos);
    let reserved = row.map_or(0, |b| b.reserved_nanos);
    json!({
        "limit_usd": limit.map(dollars),
        "period": period,
        "spent_usd": dollars(spent),
        "reserved_usd": dollars(reserved),
        "remaining_usd": limit.map(|l| dollars((l - spent - reserved).max(0))),
        "resets_at": row.and_then(|b| b.period_ms.map(|p| rfc3339(b.period_start + p))),
        "total_spent_usd": dollars(row.map_or(0, |b| b.total_nanos)),
        "calls": row.map_or(0, |b| b.calls),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn a_spec_sets_clears_and_refuses_what_it_cannot_mean() {
        let f = read(&spec(json!({"name": "ci", "rpm": 60, "tpm": null, "budget_usd": 2.5, "budget_period": "30d", "models": ["bot"], "metadata": {"team": "x"}})))
            .unwrap()
            .change;
        assert_eq!(f.name.as_deref(), Some("ci"));
        assert_eq!(f.rpm, Some(Some(60)));
        assert_eq!(f.tpm, Some(None));
        assert_eq!(f.budget_nanos, Some(Some(2_500_000_000)));
        assert_eq!(f.budget_period, Some(Some("30d".into())));
        assert_eq!(f.models, Some(Some(vec!["bot".into()])));
        assert_eq!(f.expires_at, None);
        let in_a_day = read(&spec(json!({"expires_in": "1d"}))).unwrap().change;
        let t = in_a_day.expires_at.flatten().unwrap();
        assert!((t - now_ms() - 86_400_000).abs() < 60_000);
        for bad in [
            json!({"rpm": 0}),
            json!({"rpm": "60"}),
            json!({"budget_usd": -1}),
            json!({"budget_period": "1w"}),
            json!({"models": "bot"}),
            json!({"metadata": [1]}),
            json!({"expires_at": "tomorrow"}),
            json!({"expires_at": "2030-01-01T00:00:00Z", "expires_in": "1d"}),
            json!({"budget": 3}),
        ] {
            assert!(read(&spec(bad.clone())).is_err(), "{bad}");
        }
    }
}
