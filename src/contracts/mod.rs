//! Contracts: what a route's answers must satisfy before idem treats them as
//! a success, and the certification that decides where automatic failover
//! may send work (docs/design.md, "Providers and certified failover").
//!
//! A route may name a contract file (TOML): a JSON Schema for the assistant
//! content, `required` keys, `forbid_extra_top_level_keys`, value checks per
//! key, and golden cases with expected values. [`Contract::load`] reads and
//! compiles it once at start-up (an invalid file stops start-up with an error
//! that names it); its [`Contract::hash`] covers the contract file and its
//! schema file, so editing either voids every older certification.
//!
//! The pieces: [`check`] validates one answer (run time and certification);
//! [`tokens`] counts prompt tokens where a target's tokenizer is known;
//! [`CertSlot`] holds a target's latest certification. Running the golden
//! cases against targets, keeping the slots fresh and the failover rule are
//! [`crate::certification`]'s: it works on routes, which hold contracts.

pub mod check;
pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::answer::{Answer, Failure};
use crate::store::Certification;

pub use check::Violation;

/// A contract file that cannot be used; every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    #[error("cannot read contract file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("contract {path}: {message}")]
    Parse { path: String, message: String },
    #[error("contract {path}: {message}")]
    Invalid { path: String, message: String },
    #[error("contract {path}: cannot read schema file {schema}: {source}")]
    SchemaRead {
        path: String,
        schema: String,
        #[source]
        source: std::io::Error,
    },
    #[error("contract {path}: schema file {schema}: {message}")]
    Schema {
        path: String,
        schema: String,
        message: String,
    },
}

/// The contract file as written (docs/design.md, "Providers and certified failover").
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ContractFile {
    /// JSON Schema for the assistant content, relative to the contract file.
    #[serde(default)]
    schema: Option<PathBuf>,
    #[serde(default)]
    forbid_extra_top_level_keys: bool,
    #[serde(default)]
    required: Vec<String>,
    #[serde(default)]
    temperature: f64,
    #[serde(default = "one")]
    runs_per_case: u32,
    /// Default `max_tokens` of the cases (sent, and counted in the context
    /// window check).
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    checks: BTreeMap<String, CheckFile>,
    #[serde(default)]
    cases: Vec<CaseFile>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckFile {
    #[serde(default, rename = "enum")]
    allowed: Option<Vec<Value>>,
    #[serde(default)]
    max_length: Option<usize>,
    #[serde(default)]
    pattern: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaseFile {
    #[serde(default)]
    name: Option<String>,
    messages: Vec<Value>,
    #[serde(default)]
    expect: Map<String, Value>,
    #[serde(default)]
    max_tokens: Option<u32>,
}

/// One golden case: a real prompt and what its answer must contain.
#[derive(Debug, Clone)]
pub struct Case {
    /// 1-based, as reports print it.
    pub number: usize,
    pub name: Option<String>,
    pub messages: Vec<Value>,
    /// Top-level key (or JSON pointer, when it starts with `/`) -> value.
    pub expect: Map<String, Value>,
    /// The case's `max_tokens`, else the contract's.
    pub max_tokens: Option<u32>,
}

/// A loaded, compiled contract.
#[derive(Debug)]
pub struct Contract {
    pub path: PathBuf,
    pub schema_path: Option<PathBuf>,
    /// `c1:<blake3 hex>` of the contract file and its schema file.
    pub hash: String,
    pub temperature: f64,
    pub runs_per_case: u32,
    pub cases: Vec<Case>,
    rules: check::Rules,
}

impl Contract {
    /// Reads, validates and compiles the contract at `path`.
    pub fn load(path: &Path) -> Result<Contract, ContractError> {
        let shown = path.display().to_string();
        let invalid = |message: String| ContractError::Invalid {
            path: shown.clone(),
            message,
        };
        let text = std::fs::read(path).map_err(|e| ContractError::Read {
            path: shown.clone(),
            source: e,
        })?;
        let file: ContractFile = std::str::from_utf8(&text)
            .map_err(|e| e.to_string())
            .and_then(|t| toml::from_str(t).map_err(|e| e.to_string()))
            .map_err(|message| ContractError::Parse {
                path: shown.clone(),
                message: message.trim().replace('\n', " "),
            })?;

        let (schema_path, schema_text, schema) = match &file.schema {
            None => (None, Vec::new(), None),
            Some(rel) => {
                let p = match path.parent() {
                    Some(dir) if rel.is_relative() => dir.join(rel),
                    _ => rel.clone(),
                };
                let schema_shown = p.display().to_string();
                let bytes = std::fs::read(&p).map_err(|e| ContractError::SchemaRead {
                    path: shown.clone(),
                    schema: schema_shown.clone(),
                    source: e,
                })?;
                let value: Value =
                    serde_json::from_slice(&bytes).map_err(|e| ContractError::Schema {
                        path: shown.clone(),
                        schema: schema_shown.clone(),
                        message: format!("not JSON: {e}"),
                    })?;
                (Some(p), bytes, Some((schema_shown, value)))
            }
        };

        if file.runs_per_case == 0 || file.runs_per_case > 100 {
            return Err(invalid("`runs_per_case` must be within 1..=100".into()));
        }
        if !(0.0..=2.0).contains(&file.temperature) {
            return Err(invalid("`temperature` must be within 0.0..=2.0".into()));
        }
        if file.max_tokens == Some(0) {
            return Err(invalid("`max_tokens` must be above zero".into()));
        }
        if file.cases.is_empty() {
            return Err(invalid(
                "a contract needs at least one [[cases]] entry: certification runs them".into(),
            ));
        }
        let mut cases = Vec::with_capacity(file.cases.len());
        for (i, c) in file.cases.into_iter().enumerate() {
            let at = format!("cases[{i}]");
            if c.messages.is_empty() {
                return Err(invalid(format!("`{at}.messages` must not be empty")));
            }
            for (m, message) in c.messages.iter().enumerate() {
                if message.get("role").and_then(Value::as_str).is_none() {
                    return Err(invalid(format!(
                        "`{at}.messages[{m}]` needs a string `role`"
                    )));
                }
            }
            if c.max_tokens == Some(0) {
                return Err(invalid(format!("`{at}.max_tokens` must be above zero")));
            }
            cases.push(Case {
                number: i + 1,
                name: c.name,
                messages: c.messages,
                expect: c.expect,
                max_tokens: c.max_tokens.or(file.max_tokens),
            });
        }

        let mut checks = Vec::new();
        for (key, c) in file.checks {
            if key.is_empty() {
                return Err(invalid("a [checks] key must not be empty".into()));
            }
            let pattern =
                match &c.pattern {
                    None => None,
                    Some(p) => Some(regex::Regex::new(p).map_err(|e| {
                        invalid(format!("`checks.{key}.pattern` is not a regex: {e}"))
                    })?),
                };
            if c.allowed.as_ref().is_some_and(Vec::is_empty) {
                return Err(invalid(format!("`checks.{key}.enum` must not be empty")));
            }
            checks.push(check::KeyCheck {
                key,
                allowed: c.allowed,
                max_length: c.max_length,
                pattern,
            });
        }

        let validator =
            match &schema {
                None => None,
                Some((schema_shown, value)) => Some(jsonschema::validator_for(value).map_err(
                    |e| ContractError::Schema {
                        path: shown.clone(),
                        schema: schema_shown.clone(),
                        message: format!("not a valid JSON Schema: {e}"),
                    },
                )?),
            };
        let mut known: BTreeSet<String> = file.required.iter().cloned().collect();
        known.extend(checks.iter().map(|c| c.key.clone()));
        if let Some(props) = schema
            .as_ref()
            .and_then(|(_, v)| v.get("properties"))
            .and_then(Value::as_object)
        {
            known.extend(props.keys().cloned());
        }
        if file.forbid_extra_top_level_keys && known.is_empty() {
            return Err(invalid(
                "`forbid_extra_top_level_keys` needs the allowed keys: a schema with \
                 `properties`, `required` or [checks]"
                    .into(),
            ));
        }

        Ok(Contract {
            path: path.to_path_buf(),
            schema_path,
            hash: contract_hash(&text, &schema_text),
            temperature: file.temperature,
            runs_per_case: file.runs_per_case,
            cases,
            rules: check::Rules {
                validator,
                required: file.required,
                forbid_extra: file.forbid_extra_top_level_keys.then_some(known),
                checks,
            },
        })
    }

    /// Checks the assistant content of an answer (run time): the first
    /// violation, if any.
    pub fn check_content(&self, content: &str) -> Result<Value, Violation> {
        self.rules.check(content)
    }

    /// Checks a whole chat completion: every choice's content.
    pub fn check_completion(&self, completion: &Value) -> Result<(), Violation> {
        check::check_completion(&self.rules, completion)
    }

    /// Certification: the content and the case's expectations.
    pub fn check_case(&self, case: &Case, content: &str) -> Result<(), Violation> {
        let value = self.rules.check(content)?;
        check::expectations(&case.expect, &value)
    }

    /// The short form of the hash for reports.
    pub fn short_hash(&self) -> &str {
        short_hash(&self.hash)
    }
}

/// `c1:` and the first 12 hex digits.
pub fn short_hash(hash: &str) -> &str {
    hash.get(..15).unwrap_or(hash)
}

/// BLAKE3 over both files, each with its length, so moving bytes from one
/// file to the other still changes the hash.
fn contract_hash(contract: &[u8], schema: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"idem-contract-v1\0");
    for part in [contract, schema] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    format!("c1:{}", h.finalize().to_hex())
}

/// The run-time hook: an answer on a route with a contract becomes a
/// `contract_violation` failure unless every choice satisfies it. Errors
/// and non-success answers pass through unchanged.
pub fn enforce(contract: &Contract, route: &str, answer: Answer) -> Answer {
    if !answer.is_success() {
        return answer;
    }
    // A chat completion: every choice's content; an answer of another
    // dialect: its text (a message's text blocks, a response's output
    // text).
    let verdict = match answer.dialect {
        crate::dialect::Dialect::Chat => match answer.plain_json() {
            Some(completion) => contract.check_completion(&completion),
            None => Err(Violation::new(
                "",
                "not_json",
                "the provider's answer is not a chat completion",
            )),
        },
        _ => match answer.text() {
            Some(text) => contract.check_content(&text).map(|_| ()),
            None => Err(Violation::new(
                "",
                "no_content",
                "the answer has no text content",
            )),
        },
    };
    let Err(violation) = verdict else {
        return answer;
    };
    tracing::warn!(
        route,
        provider = %answer.provider,
        model = %answer.model,
        contract = short_hash(&contract.hash),
        path = %violation.path,
        rule = violation.rule,
        violation = %violation.message,
        "answer broke the route's contract"
    );
    let message = format!(
        "the answer of provider {} broke the route's contract: {violation}",
        answer.provider
    );
    let mut failed = Answer::from_failure(
        Failure::Contract,
        &message,
        answer.provider.clone(),
        answer.model.clone(),
    );
    failed.upstream_latency = answer.upstream_latency;
    failed
}

/// Loads the contract of every route that names one.
pub fn load_all(
    config: &crate::config::Config,
) -> Result<BTreeMap<String, Arc<Contract>>, ContractError> {
    let mut out = BTreeMap::new();
    for route in &config.routes {
        if let Some(path) = &route.contract {
            out.insert(route.model.clone(), Arc::new(Contract::load(path)?));
        }
    }
    Ok(out)
}

/// A target's latest certification for its route (any contract hash).
#[derive(Debug, Default)]
pub struct CertSlot(RwLock<Option<Certification>>);

impl CertSlot {
    /// Keeps the newer of the held and the offered certification. Two
    /// refreshes may overlap (the periodic one and an admin certify's); a
    /// read that started before a certification was written must not put
    /// the older state back.
    pub fn set(&self, c: Option<Certification>) {
        // A poisoned lock still holds a whole value.
        let mut held = self.0.write().unwrap_or_else(|p| p.into_inner());
        let newer = match (&*held, &c) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(old), Some(new)) => new.certified_at >= old.certified_at,
        };
        if newer {
            *held = c;
        }
    }

    pub fn get(&self) -> Option<Certification> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Passed, for exactly this contract hash.
    pub fn valid_for(&self, hash: &str) -> bool {
        self.0
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|c| c.passed && c.contract_hash == hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn temp() -> PathBuf {
        let d = std::env::temp_dir().join(format!("idem-contract-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const CONTRACT: &str = r#"
schema = "reply.schema.json"
forbid_extra_top_level_keys = true
required = ["answer", "category"]
runs_per_case = 2
[checks.category]
enum = ["billing", "delivery", "other"]
[[cases]]
messages = [{role = "user", content = "Where is my order 1234?"}]
expect = { category = "delivery" }
"#;
    const SCHEMA: &str = r#"{"type": "object", "properties": {"answer": {"type": "string"}, "category": {"type": "string"}}}"#;

    #[test]
    fn loads_and_resolves_the_schema_next_to_the_contract() {
        let d = temp();
        write(&d, "reply.schema.json", SCHEMA);
        let c = Contract::load(&write(&d, "c.toml", CONTRACT)).unwrap();
        assert_eq!(
            c.schema_path.as_deref(),
            Some(d.join("reply.schema.json").as_path())
        );
        assert_eq!(c.runs_per_case, 2);
        assert_eq!(c.cases.len(), 1);
        assert!(
            c.hash.starts_with("c1:") && c.hash.len() == 67,
            "{}",
            c.hash
        );
        assert!(
            c.check_content(r#"{"answer": "on its way", "category": "delivery"}"#)
                .is_ok()
        );
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn the_hash_covers_the_contract_and_its_schema() {
        let d = temp();
        write(&d, "reply.schema.json", SCHEMA);
        let path = write(&d, "c.toml", CONTRACT);
        let first = Contract::load(&path).unwrap().hash;
        assert_eq!(Contract::load(&path).unwrap().hash, first, "stable");
        write(
            &d,
            "reply.schema.json",
            &SCHEMA.replace("string\"}}", "string\", \"maxLength\": 9}}"),
        );
        let schema_edited = Contract::load(&path).unwrap().hash;
        assert_ne!(schema_edited, first, "a schema edit must void certificates");
        write(
            &d,
            "c.toml",
            &CONTRACT.replace("runs_per_case = 2", "runs_per_case = 3"),
        );
        assert_ne!(Contract::load(&path).unwrap().hash, schema_edited);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn invalid_contracts_name_the_file() {
        let d = temp();
        write(&d, "reply.schema.json", SCHEMA);
        let cases = [
            (
                "typo.toml",
                CONTRACT.replace("required", "requird"),
                "requird",
            ),
            (
                "nocases.toml",
                CONTRACT.split("[[cases]]").next().unwrap().to_string(),
                "[[cases]]",
            ),
            (
                "regex.toml",
                format!("{CONTRACT}\n[checks.answer]\npattern = \"(\"\n"),
                "pattern",
            ),
            (
                "schema.toml",
                CONTRACT.replace("reply.schema.json", "missing.json"),
                "missing.json",
            ),
            (
                "runs.toml",
                CONTRACT.replace("runs_per_case = 2", "runs_per_case = 0"),
                "runs_per_case",
            ),
        ];
        for (name, text, needle) in cases {
            let err = Contract::load(&write(&d, name, &text))
                .unwrap_err()
                .to_string();
            assert!(err.contains(name), "{name}: {err}");
            assert!(err.contains(needle), "{name}: {err}");
        }
        write(&d, "bad.schema.json", r#"{"type": 12}"#);
        let text = CONTRACT.replace("reply.schema.json", "bad.schema.json");
        let err = Contract::load(&write(&d, "badschema.toml", &text))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("badschema.toml") && err.contains("bad.schema.json"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn the_example_contract_loads() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts/support.toml");
        let c = Contract::load(&p).unwrap();
        assert!(c.cases.len() >= 2);
        assert!(c.schema_path.is_some());
    }

    fn answer(content: &str) -> Answer {
        let body = serde_json::json!({
            "id": "x", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
        });
        Answer {
            dialect: crate::dialect::Dialect::Chat,
            status: reqwest::StatusCode::OK,
            form: crate::answer::Form::Plain,
            body: bytes::Bytes::from(body.to_string()),
            retry_after: None,
            failure: None,
            provider: "p".into(),
            model: "m".into(),
            created_at: std::time::SystemTime::now(),
            upstream_latency: std::time::Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        }
    }

    #[test]
    fn enforce_turns_a_violation_into_a_contract_failure() {
        let d = temp();
        write(&d, "reply.schema.json", SCHEMA);
        let c = Contract::load(&write(&d, "c.toml", CONTRACT)).unwrap();
        let ok = enforce(&c, "r", answer(r#"{"answer": "a", "category": "other"}"#));
        assert!(ok.is_success());
        let bad = enforce(&c, "r", answer(r#"{"answer": "a", "category": "refund"}"#));
        assert!(!bad.is_success());
        assert_eq!(
            bad.verdict(),
            crate::answer::Verdict::Failed("contract_violation")
        );
        let text = String::from_utf8_lossy(&bad.body).into_owned();
        assert!(text.contains("/category"), "{text}");
        let prose = enforce(&c, "r", answer("Sure! Your order is on its way."));
        assert_eq!(prose.failure, Some(Failure::Contract));
        let _ = std::fs::remove_dir_all(d);
    }

    fn certification(at: i64, passed: bool) -> Certification {
        Certification {
            route: "bot".into(),
            provider: "fallback".into(),
            model: "m".into(),
            contract_hash: "c1:x".into(),
            passed,
            failures: "[]".into(),
            certified_at: at,
        }
    }

    #[test]
    fn a_stale_refresh_never_puts_an_older_state_back() {
        let slot = CertSlot::default();
        slot.set(Some(certification(2, true)));
        // A refresh that read the store before that certification was written.
        slot.set(None);
        slot.set(Some(certification(1, false)));
        assert!(slot.valid_for("c1:x"));
        slot.set(Some(certification(3, false)));
        assert!(!slot.valid_for("c1:x"));
    }
}
