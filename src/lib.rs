//! idem: an OpenAI-compatible LLM gateway that does each piece of work once.
//!
//! # Layout
//!
//! The modules follow a request (docs/design.md, "The request path"):
//!
//! - [`http`]: the router, authentication ([`tenants`]), validation, and the
//!   faces (`openai`: the conversation path of every dialect, which
//!   `faces` renders, and models; `embeddings`; `responses`: stored
//!   responses; `jobs`; `ops`), which turn a request into the core's task
//!   and the core's answer (or error) into an HTTP answer, in one place
//!   each;
//! - [`dialect`]: the API dialects a request and its answer keep from face
//!   to target (chat completions, Anthropic's Messages API, OpenAI's
//!   Responses API, embeddings): what a whole answer of each is, its plain
//!   and streamed forms; [`endpoints`]: each dialect's upstream call as the
//!   core sees it; [`translate`]: translation between two dialects, only
//!   where a target speaks another than its request's; [`conversations`]:
//!   stored responses and the conversations they continue;
//! - [`routes`]: public model names mapped to their ordered targets;
//! - [`fingerprint`]: what counts as the same task;
//! - [`task`]: the core: a task in, a delivery out, one function per stage
//!   (result cache, the route's targets, the flight), and the one place a
//!   request is counted and logged; [`outcome`] names what happened;
//! - [`cache`]: the result and negative caches;
//! - [`flight`]: one upstream call per fingerprint in flight (leader and
//!   followers; one call for several flights when an endpoint batches);
//! - [`keys`]: the API keys kept in the store, with their limits;
//!   [`budgets`]: what a key and its tenant may still spend, reserved
//!   before a call and settled after it;
//! - [`jobs`]: idempotency keys, the job and attempt state machine, the
//!   executor and the reconciler, over the [`store`] (SQLite or
//!   PostgreSQL); [`lease`]: how every holder renews what it holds;
//!   [`batches`]: OpenAI's Batch API, each line a job, identical lines one
//!   call;
//! - [`providers`]: the upstream call itself (and each target's circuit
//!   breaker); [`answer`] is what it yields, and [`sse`] converts a chat
//!   answer between streamed and plain form;
//! - [`contracts`]: what a route's answers must satisfy; [`certification`]:
//!   running a contract's cases against targets, and the rule that sends
//!   failover only to certified targets (the target walk).
//!
//! Around them: [`config`] and [`live`] (the configuration in force, which
//! a reload replaces whole), [`metrics`], the request log ([`reqlog`]),
//! [`app`] (start-up and shutdown), [`cli`], the [`demo`], [`analyze`] (what
//! a request log says about duplicates, TTL and wait window), and
//! [`mock_upstream`], the test double for providers.
//!
//! Only [`http`] (and the start-up around it) knows HTTP: the modules below
//! it return errors of their own (`TaskError`, `FlightError`, `JobError`,
//! `StoreError`, ...), which `http::error` turns into OpenAI error objects;
//! a unit test (`layout`) keeps them free of the HTTP layer and its
//! framework, and another keeps the top-level modules free of import
//! circles.

pub mod analyze;
pub mod answer;
pub mod app;
pub mod batches;
pub mod budgets;
pub mod cache;
pub mod certification;
pub mod cli;
pub mod config;
pub mod contracts;
pub mod conversations;
pub mod demo;
pub mod dialect;
pub mod endpoints;
pub mod fingerprint;
pub mod flight;
pub mod http;
pub mod jobs;
pub mod keys;
pub mod lease;
pub mod live;
pub mod metrics;
pub mod mock_upstream;
pub mod outcome;
pub mod prices;
pub mod providers;
pub mod reqlog;
pub mod routes;
pub mod sse;
pub mod store;
pub mod task;
pub mod telemetry;
pub mod tenants;
pub mod timeline;
pub mod translate;

/// PostgreSQL and Redis for the unit tests, found or started once per test
/// process; shared with the integration and chaos tests.
#[cfg(test)]
#[path = "../tests/support/services.rs"]
pub(crate) mod test_services;

#[cfg(test)]
mod layout {
    use std::path::Path;

    /// The modules below the HTTP layer: they know neither it nor its
    /// framework, so that every face (HTTP today) is an adapter around them.
    const CORE: &[&str] = &[
        "analyze",
        "answer",
        "budgets",
        "cache",
        "certification",
        "config",
        "contracts",
        "conversations",
        "dialect",
        "endpoints",
        "fingerprint",
        "flight",
        "jobs",
        "keys",
        "lease",
        "live",
        "metrics",
        "outcome",
        "prices",
        "providers",
        "reqlog",
        "routes",
        "sse",
        "store",
        "task",
        "telemetry",
        "tenants",
        "translate",
    ];

    fn sources(path: &Path, out: &mut Vec<std::path::PathBuf>) {
        if path.is_dir() {
            let mut entries: Vec<_> = std::fs::read_dir(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .flatten()
                .map(|e| e.path())
                .collect();
            entries.sort();
            for p in entries {
                sources(&p, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_path_buf());
        }
    }

    #[test]
    fn the_core_knows_no_http() {
        // Spelled in pieces, so that this file does not name them itself.
        let forbidden = [["crate", "http"].join("::"), ["ax", "um"].concat()];
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut offenders = Vec::new();
        for module in CORE {
            let mut files = Vec::new();
            let dir = src.join(module);
            sources(&dir, &mut files);
            sources(&src.join(format!("{module}.rs")), &mut files);
            assert!(!files.is_empty(), "module {module} has no source");
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                for (n, line) in text.lines().enumerate() {
                    if forbidden.iter().any(|f| line.contains(f.as_str())) {
                        offenders.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                    }
                }
            }
        }
        assert!(offenders.is_empty(), "{}", offenders.join("\n"));
    }

    /// The top-level modules and the others each one's code names
    /// (`crate::<module>` outside comments and tests).
    fn dependencies() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut modules = std::collections::BTreeMap::new();
        let mut entries: Vec<_> = std::fs::read_dir(&src)
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for path in entries {
            let name = match path.file_stem().and_then(|n| n.to_str()) {
                Some(n) if path.is_dir() || path.extension().is_some_and(|e| e == "rs") => n,
                _ => continue,
            };
            if name == "lib" || name == "main" {
                continue;
            }
            let mut files = Vec::new();
            sources(&path, &mut files);
            modules.insert(name.to_string(), files);
        }
        let names: std::collections::BTreeSet<String> = modules.keys().cloned().collect();
        let mut graph = std::collections::BTreeMap::new();
        for (name, files) in &modules {
            let mut uses = std::collections::BTreeSet::new();
            for f in files.iter().filter(|f| !f.ends_with("tests.rs")) {
                let text = std::fs::read_to_string(f).unwrap_or_default();
                let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or_default();
                for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                    for (at, _) in line.match_indices("crate::") {
                        let used: String = line[at + 7..]
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if used != *name && names.contains(&used) {
                            uses.insert(used);
                        }
                    }
                }
            }
            graph.insert(name.clone(), uses);
        }
        graph
    }

    /// No two top-level modules depend on each other, however indirectly:
    /// the layers can be read from the bottom up.
    #[test]
    fn no_import_circle_between_top_level_modules() {
        let graph = dependencies();
        assert!(graph.contains_key("flight") && graph["http"].contains("flight"));
        // Depth-first, keeping the path: a module met again on its own path
        // closes a circle.
        fn visit(
            m: &str,
            graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
            path: &mut Vec<String>,
            done: &mut std::collections::BTreeSet<String>,
        ) {
            if let Some(at) = path.iter().position(|p| p == m) {
                panic!("import circle: {} -> {m}", path[at..].join(" -> "));
            }
            if done.contains(m) {
                return;
            }
            path.push(m.to_string());
            for next in &graph[m] {
                visit(next, graph, path, done);
            }
            path.pop();
            done.insert(m.to_string());
        }
        let mut done = std::collections::BTreeSet::new();
        for m in graph.keys() {
            visit(m, &graph, &mut Vec::new(), &mut done);
        }
    }
}
