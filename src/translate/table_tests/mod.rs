//! The tests of docs/http-api.md's table "What becomes of each field":
//! one table of cases per face and target kind, each case labelled as the
//! table cites it (`face_to_target`, case `label`). Every case goes through
//! [`prepare`], the dispatch the request path calls, with a target of the
//! kind built from a configuration, and says what the target is sent: a
//! value at a place in the body, nothing there, the same body as without
//! the field (a field left out), or a refusal naming the field.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{Prepared, Refusal, prepare};
use crate::config::{Config, Source};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::providers::Providers;
use crate::routes::{Route, Routes, Target};

/// One provider of each kind, and a route (named after the target) to
/// each model the cases need.
const CONFIG: &str = r#"
[[providers]]
name = "oa"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"

[[providers]]
name = "az"
kind = "azure"
base_url = "http://127.0.0.1:9"

[[providers]]
name = "an"
kind = "anthropic"
base_url = "http://127.0.0.1:9"

[[providers]]
name = "rs"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
responses_api = true

[[providers]]
name = "mk"
kind = "mock"

[[routes]]
model = "openai"
targets = [{ provider = "oa", model = "gpt-4o" }]

[[routes]]
model = "openai-reasoning"
targets = [{ provider = "oa", model = "o4-mini" }]

[[routes]]
model = "azure"
targets = [{ provider = "az", model = "gpt-4o" }]

[[routes]]
model = "azure-deployment"
targets = [{ provider = "az", model = "my-deployment" }]

[[routes]]
model = "anthropic"
targets = [{ provider = "an", model = "claude-x" }]

[[routes]]
model = "responses-api"
targets = [{ provider = "rs", model = "gpt-4o" }]

[[routes]]
model = "mock"
targets = [{ provider = "mk", model = "gpt-4o" }]
"#;

/// The targets of [`CONFIG`], by route name.
struct Targets(Routes);

impl Targets {
    fn new() -> Targets {
        let config = Config::from_toml_str(CONFIG, Source::Embedded, false).unwrap();
        let metrics = Metrics::new(&config);
        let providers = Providers::from_config(&config).unwrap();
        Targets(Routes::from_config(&config, &providers, &metrics).unwrap())
    }

    /// The route named `route`, whose first target the cases use.
    fn get(&self, route: &str) -> Arc<Route> {
        self.0.get(route).unwrap()
    }
}

/// What a target gets for a request.
#[derive(Debug)]
enum Sent {
    /// The request in its own dialect (the target speaks it), and the
    /// client's headers.
    Native(Value, Forwarded),
    /// The request translated into `dialect`.
    Translated(Dialect, Value),
    /// No call: idem's own answer.
    Local(Value),
}

impl Sent {
    fn body(&self) -> &Value {
        match self {
            Sent::Native(v, _) | Sent::Translated(_, v) | Sent::Local(v) => v,
        }
    }
}

fn json_of(bytes: &Bytes) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// Sends `request` of dialect `from` to `target` through [`prepare`],
/// with an `anthropic-beta` header from the client.
fn send(from: Dialect, request: &Value, target: &Target) -> Result<Sent, Refusal> {
    let forwarded = Forwarded::read(from, |name| match name {
        "anthropic-beta" => vec!["tools-2099"],
        "openai-beta" => vec!["responses=v9"],
        _ => vec![],
    });
    let fp = Fingerprint::from_bytes([7; 32]);
    let request = object(request.clone());
    Ok(match prepare(from, &request, &forwarded, target, &fp)? {
        Prepared::Local(body) => Sent::Local(json_of(&body)),
        // A native call keeps the dialect (its reply is read as it comes,
        // or, for a continued conversation, with the client's fields).
        Prepared::Send(s) if s.dialect == from => Sent::Native(json_of(&s.body), s.forwarded),
        Prepared::Send(s) => {
            assert_eq!(
                s.forwarded,
                Forwarded::default(),
                "a translated call carries no client header"
            );
            Sent::Translated(s.dialect, json_of(&s.body))
        }
    })
}

/// What a case wants of the target's body.
enum Want {
    /// This value at this JSON pointer.
    At(&'static str, Value),
    /// Nothing at this pointer.
    Absent(&'static str),
    /// The body the base request alone becomes: the field was left out.
    Same,
    /// Refused before anything is sent, naming this field.
    Refused(&'static str),
}

/// One row (or part of a row) of the table.
struct Case {
    label: &'static str,
    /// Top-level fields set over the table's base request (`null`: the
    /// field removed).
    patch: Value,
    wants: Vec<Want>,
}

fn case(label: &'static str, patch: Value, wants: Vec<Want>) -> Case {
    Case {
        label,
        patch,
        wants,
    }
}

use Want::{Absent, At, Refused, Same};

/// The base request with `patch`'s fields set over it.
fn patched(base: &Value, patch: &Value) -> Value {
    let mut out = object(base.clone());
    for (k, v) in object(patch.clone()) {
        if v.is_null() {
            out.remove(&k);
        } else {
            out.insert(k, v);
        }
    }
    Value::Object(out)
}

/// Runs every case of a face x target table: `from` requests (the `base`
/// with each case's patch) to the target of route `route`, whose calls are
/// in `to` (the request's own dialect: passed as sent).
fn run(from: Dialect, route: &str, to: Dialect, base: Value, cases: &[Case]) {
    let targets = Targets::new();
    let route = targets.get(route);
    let target = &route.targets[0];
    let plain = send(from, &base, target).expect("the base request is sent");
    let mut failures = Vec::new();
    for c in cases {
        let request = patched(&base, &c.patch);
        let sent = send(from, &request, target);
        for want in &c.wants {
            let problem = match (want, &sent) {
                (Refused(param), Err(r)) => {
                    let named = r.param.as_deref() == Some(*param);
                    let says_target = r.message.contains(&*target.model);
                    (!named || !says_target).then(|| {
                        format!(
                            "refused with param {:?} ({}), wanted {param:?} and the target named",
                            r.param, r.message
                        )
                    })
                }
                (Refused(param), Ok(s)) => Some(format!(
                    "not refused (wanted param {param:?}): sent {}",
                    s.body()
                )),
                (_, Err(r)) => Some(format!("refused: {:?} {}", r.param, r.message)),
                (want, Ok(s)) => {
                    let dialect = match s {
                        Sent::Native(..) => Some(from),
                        Sent::Translated(d, _) => Some(*d),
                        Sent::Local(_) => None,
                    };
                    if dialect.is_some() && dialect != Some(to) {
                        Some(format!("sent as {dialect:?}, wanted {to:?}"))
                    } else {
                        let body = s.body();
                        match want {
                            At(ptr, v) => (body.pointer(ptr) != Some(v)).then(|| {
                                format!(
                                    "at {ptr}: {:?}, wanted {v} (body {body})",
                                    body.pointer(ptr)
                                )
                            }),
                            Absent(ptr) => body
                                .pointer(ptr)
                                .map(|v| format!("at {ptr}: {v}, wanted nothing")),
                            Same => (body != plain.body()).then(|| {
                                format!("changed the body: {body}, without it {}", plain.body())
                            }),
                            Refused(_) => unreachable!(),
                        }
                    }
                }
            };
            if let Some(p) = problem {
                failures.push(format!("case `{}`: {p}", c.label));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

mod chat_messages;
mod messages_chat;
mod native;
mod responses_chat;
