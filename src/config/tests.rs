//! Tests of whole configurations, loaded and validated as at start-up.

use std::time::Duration;

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(text, Source::File("test.toml".into()), false)
}

#[test]
fn embedded_default_is_valid() {
    let c = Config::from_toml_str(EMBEDDED_DEFAULT, Source::Embedded, false).unwrap();
    assert_eq!(c.server.listen, "127.0.0.1:8080");
    assert_eq!(c.storage.url, "sqlite://idem.db");
    assert_eq!(c.coalescing.backend, "memory");
    assert!(c.routes.iter().any(|r| r.model == "mock"));
}

#[test]
fn spec_example_parses() {
    let text = r#"
[server]
listen = "127.0.0.1:8080"
request_timeout = "120s"
max_body_bytes = 8388608
[storage]
url = "sqlite://idem.db"
idempotency_retention = "24h"
[coalescing]
backend = "memory"
[admin]
api_keys = ["admin-key-1"]
[[tenants]]
name = "acme"
api_keys = ["sk-acme-1"]
[[providers]]
name = "primary"
kind = "openai"
base_url = "http://127.0.0.1:9001/v1"
api_key_env = "PRIMARY_API_KEY"
timeout = "30s"
[[providers]]
name = "fallback"
kind = "openai"
base_url = "http://127.0.0.1:9002/v1"
[[routes]]
model = "support-bot"
targets = [ { provider = "primary", model = "gpt-4o-mini" },
            { provider = "fallback", model = "llama-3.1-8b" } ]
normalize = "none"
scope = "tenant"
[routes.cache]
enabled = true
ttl = "30s"
jitter = 0.15
[routes.coalesce]
enabled = true
max_wait = "auto"
on_wait_timeout = "fail"
[routes.attempts]
max = 3
timeout = "30s"
hedge_after = "10s"
"#;
    let c = parse(text).unwrap();
    let r = &c.routes[0];
    assert_eq!(r.targets.len(), 2);
    assert_eq!(r.coalesce.max_wait, MaxWait::Auto);
    assert_eq!(r.attempts.hedge_after, Some(Duration::from_secs(10)));
    assert_eq!(c.storage.idempotency_retention, Duration::from_secs(86400));
}

#[test]
fn unknown_key_is_named() {
    let err = parse("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("test.toml"), "{err}");
    assert!(err.contains("lisen"), "{err}");
}

#[test]
fn unknown_provider_names_the_route_key() {
    let text = r#"
[[providers]]
name = "primary"
kind = "mock"
[[routes]]
model = "m"
targets = [{ provider = "primray", model = "x" }]
"#;
    let err = parse(text).unwrap_err().to_string();
    assert!(err.contains("routes[0].targets[0].provider"), "{err}");
    assert!(err.contains("test.toml"), "{err}");
}

#[test]
fn open_gateway_on_public_address_is_refused() {
    let err = parse("[server]\nlisten = \"0.0.0.0:8080\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("tenants"), "{err}");
}

#[test]
fn an_openai_base_url_must_parse_as_an_http_url() {
    let with = |url: &str| {
        parse(&format!(
            "[[providers]]\nname = \"p\"\nkind = \"openai\"\nbase_url = \"{url}\"\n[[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n"
        ))
    };
    for bad in [
        "",
        "api.example.com/v1",
        "ftp://example.com/v1",
        "http://exa mple.com/v1",
        "http://[::1/v1",
    ] {
        let err = with(bad).unwrap_err().to_string();
        assert!(err.contains("providers[0].base_url"), "{bad:?}: {err}");
    }
    for good in ["http://127.0.0.1:9001/v1", "https://api.example.com/v1/"] {
        assert!(with(good).is_ok(), "{good:?}");
    }
}

#[test]
fn bad_duration_names_the_key() {
    let text = "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\ntargets = [{ provider = \"p\", model = \"x\" }]\n[routes.cache]\nttl = \"soon\"\n";
    let err = parse(text).unwrap_err().to_string();
    assert!(err.contains("ttl"), "{err}");
}

#[test]
fn breaker_contracts_and_context_window_keys() {
    let text = r#"
[breaker]
failures = 2
cooldown = "5s"
[contracts]
refresh_interval = "1s"
[[providers]]
name = "a"
kind = "mock"
context_window = 4096
[providers.breaker]
failures = 7
cooldown = "1m"
[[providers]]
name = "b"
kind = "mock"
[[routes]]
model = "m"
targets = [{ provider = "a", model = "x", context_window = 1024 }, { provider = "b", model = "y" }]
"#;
    let c = parse(text).unwrap();
    assert_eq!(c.breaker_for("a").failures, 7);
    assert_eq!(c.breaker_for("b").cooldown, Duration::from_secs(5));
    assert_eq!(c.contracts.refresh_interval, Duration::from_secs(1));
    assert_eq!(c.providers[0].context_window, Some(4096));
    assert_eq!(c.routes[0].targets[0].context_window, Some(1024));
    let err = parse("[breaker]\nfailures = 3\ncooldown = \"0s\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("breaker.cooldown"), "{err}");
    let err = parse(&text.replace("context_window = 1024", "context_window = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("routes[0].targets[0].context_window"), "{err}");
}

#[test]
fn answer_and_cache_byte_limits_have_defaults_and_must_be_above_zero() {
    let text = "[[providers]]\nname = \"a\"\nkind = \"mock\"\n\
                [[providers]]\nname = \"b\"\nkind = \"mock\"\nmax_answer_bytes = 65536\n";
    let c = parse(text).unwrap();
    assert_eq!(c.providers[0].max_answer_bytes, 8 * 1024 * 1024);
    assert_eq!(c.providers[1].max_answer_bytes, 65536);
    assert_eq!(c.coalescing.cache_max_bytes, 256 * 1024 * 1024);
    let err = parse(&text.replace("65536", "0")).unwrap_err().to_string();
    assert!(err.contains("providers[1].max_answer_bytes"), "{err}");
    let c = parse("[coalescing]\ncache_max_bytes = 1048576\n").unwrap();
    assert_eq!(c.coalescing.cache_max_bytes, 1048576);
    let err = parse("[coalescing]\ncache_max_bytes = 0\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("coalescing.cache_max_bytes"), "{err}");
}

#[test]
fn a_late_window_that_could_hear_nothing_is_refused_naming_both_keys() {
    let route = |attempts: &str| {
        format!(
            "[[providers]]\nname = \"p\"\nkind = \"mock\"\ntimeout = \"30s\"\n\
             [[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n\
             [routes.attempts]\n{attempts}\n"
        )
    };
    // The defaults listen for ten minutes past a 30 s attempt timeout,
    // whatever the provider's own timeout.
    let c = parse(&route("")).unwrap();
    let a = &c.routes[0].attempts;
    assert!(a.late_result_window > a.timeout);
    for dead in [
        "timeout = \"10m\"",
        "timeout = \"20m\"",
        "timeout = \"5s\"\nlate_result_window = \"5s\"",
        "late_result_window = \"0s\"",
    ] {
        let err = parse(&route(dead)).unwrap_err().to_string();
        assert!(
            err.contains("routes[0].attempts.late_result_window")
                && err.contains("routes[0].attempts.timeout"),
            "{dead}: {err}"
        );
    }
    assert!(parse(&route("timeout = \"5s\"\nlate_result_window = \"6s\"")).is_ok());
}

#[test]
fn body_timeout_and_max_connections_parse_and_are_checked() {
    let c = parse("").unwrap();
    assert_eq!(c.server.body_timeout, Duration::from_secs(30));
    assert_eq!(c.server.max_connections, MaxConnections::Auto);
    let c = parse("[server]\nbody_timeout = \"500ms\"\nmax_connections = 3\n").unwrap();
    assert_eq!(c.server.body_timeout, Duration::from_millis(500));
    assert_eq!(c.server.max_connections, MaxConnections::Fixed(3));
    let c = parse("[server]\nmax_connections = \"auto\"\n").unwrap();
    assert_eq!(c.server.max_connections, MaxConnections::Auto);
    // As an environment override may give it.
    let c = parse("[server]\nmax_connections = \"250\"\n").unwrap();
    assert_eq!(c.server.max_connections, MaxConnections::Fixed(250));
    for (text, key) in [
        ("body_timeout = \"0s\"", "server.body_timeout"),
        ("max_connections = 0", "server.max_connections"),
        ("max_connections = -1", "max_connections"),
        ("max_connections = \"many\"", "max_connections"),
        ("max_connections = 100000000", "server.max_connections"),
    ] {
        let err = parse(&format!("[server]\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{text}: {err}");
    }
}

#[test]
fn duplicate_keys_across_tenants_are_refused() {
    let text = "[[tenants]]\nname = \"a\"\napi_keys = [\"sk-same-key\"]\n[[tenants]]\nname = \"b\"\napi_keys = [\"sk-same-key\"]\n";
    let err = parse(text).unwrap_err().to_string();
    assert!(err.contains("tenants[1].api_keys[0]"), "{err}");
}

#[test]
fn the_coalescing_backend_is_memory_one_redis_or_a_cluster() {
    let backend = |b: &str| {
        parse(&format!("[coalescing]\nbackend = \"{b}\"\n"))
            .map(|c| c.coalescing.shared_backend().unwrap())
    };
    assert_eq!(backend("memory").unwrap(), SharedBackend::Memory);
    assert_eq!(
        backend("redis://127.0.0.1:6379/2").unwrap(),
        SharedBackend::Redis("redis://127.0.0.1:6379/2".into())
    );
    assert_eq!(
        backend("redis+cluster://127.0.0.1:7000,redis-b:7001,[::1]:7002/").unwrap(),
        SharedBackend::RedisCluster(vec![
            "redis://127.0.0.1:7000".into(),
            "redis://redis-b:7001".into(),
            "redis://[::1]:7002".into(),
        ])
    );
    // The credentials reach every seed node.
    assert_eq!(
        backend("redis+cluster://idem:s%40cret@a:7000,b:7000").unwrap(),
        SharedBackend::RedisCluster(vec![
            "redis://idem:s%40cret@a:7000".into(),
            "redis://idem:s%40cret@b:7000".into(),
        ])
    );
    for bad in [
        "redis+cluster://",
        "redis+cluster://a:7000,",
        "redis+cluster://a",
        "redis+cluster://a:0",
        "redis+cluster://a:70000",
        "redis+cluster://::1:7000",
        "redis+cluster://a:7000,b:7000/1",
        "redis+cluster://a:7000?protocol=3",
        "redis-cluster://a:7000",
        "cluster://a:7000",
        "",
    ] {
        let err = backend(bad).unwrap_err().to_string();
        assert!(err.contains("`coalescing.backend`"), "{bad}: {err}");
    }
    let err = backend("redis+cluster://a:7000,b").unwrap_err().to_string();
    assert!(err.contains("\"b\" is not host:port"), "{err}");
}

#[test]
fn a_route_serves_chat_by_default_and_says_so_when_it_serves_more() {
    let route = |extra: &str| {
        format!(
            "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\n{extra}\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n"
        )
    };
    let c = parse(&route("")).unwrap();
    assert_eq!(c.routes[0].endpoints, [RouteEndpoint::Chat]);
    let c = parse(&route("endpoints = [\"embeddings\", \"chat\"]")).unwrap();
    assert_eq!(
        c.routes[0].endpoints,
        [RouteEndpoint::Embeddings, RouteEndpoint::Chat]
    );
    for (extra, key) in [
        ("endpoints = []", "routes[0].endpoints"),
        ("endpoints = [\"chat\", \"chat\"]", "routes[0].endpoints[1]"),
        ("endpoints = [\"images\"]", "endpoints"),
    ] {
        let err = parse(&route(extra)).unwrap_err().to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
    let dir = std::env::temp_dir().join(format!("idem-cfg-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let contract = dir.join("c.toml");
    std::fs::write(&contract, "").unwrap();
    let err = parse(&route(&format!(
        "endpoints = [\"embeddings\"]\ncontract = \"{}\"",
        contract.display()
    )))
    .unwrap_err()
    .to_string();
    assert!(err.contains("routes[0].contract"), "{err}");
    assert!(err.contains("serves none"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every example configuration shipped in `examples/providers` loads and
/// validates as `idem check` would (keys from the environment aside).
#[test]
fn the_provider_examples_are_valid_configurations() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/providers");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let config = Config::load_with_env(Some(&path), false)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!config.routes.is_empty(), "{}", path.display());
            checked += 1;
        }
    }
    assert!(checked >= 7, "only {checked} examples");
}

/// The compose file's configuration (deploy/idem.toml) loads with the
/// overrides compose.yaml sets.
#[test]
fn the_compose_configuration_is_valid() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/idem.toml"),
    )
    .unwrap();
    let config = parse(&text).unwrap();
    assert!(!config.routes.is_empty() && !config.tenants.is_empty());
    assert!(config.warnings().is_empty());
}

/// Each class of config error says what to do: where (line and column,
/// or the variable), the key as one path, a "did you mean", the form a
/// duration takes.
#[test]
fn config_errors_say_where_and_what_to_write() {
    // A misspelt key: its line, and the key meant.
    let err = parse("[server]\nlisten = \"127.0.0.1:1\"\ntimout = \"30s\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("test.toml: line 3, column 1: `server.timout`: unknown key `timout`; did you mean `request_timeout`?"),
        "{err}"
    );
    // A duration written as a number: the accepted forms.
    let err = parse(
        "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\n\
         targets = [{ provider = \"p\", model = \"x\" }]\n[routes.cache]\nttl = 5\n",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "test.toml: line 8, column 1: `routes[0].cache.ttl`: found signed int `5`, \
         expected a duration: a number with a unit, such as \"30s\", \"500ms\", \"2m\" or \"1h\""
    );
    // A check after parsing: the key's line and column, arrays indexed.
    let err = parse(
        "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\n\
         targets = [{ provider = \"p\", model = \"x\" }, { provider = \"q\", model = \"y\" }]\n",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "test.toml: line 6, column 47: `routes[0].targets[1].provider`: unknown provider \"q\" (known: p)"
    );
    // The embedded default has no lines to point at.
    let err = Config::from_toml_str("[server]\nlisen = 1\n", Source::Embedded, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "<embedded default>: `server.lisen`: unknown key `lisen`; did you mean `listen`?"
        ),
        "{err}"
    );
}

#[test]
fn a_misplaced_key_is_not_repeated_in_the_error() {
    let err = parse("[admin]\napi_keys = \"sk-admin-secret-1\"\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("`admin.api_keys`: expected"), "{err}");
    assert!(!err.contains("sk-admin-secret-1"), "{err}");
}

#[test]
fn a_missing_file_is_reported_once() {
    let err = Config::load_with_env(Some(Path::new("/nonexistent/idem.toml")), false).unwrap_err();
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert_eq!(chain.matches("No such file").count(), 1, "{chain}");
    assert!(chain.contains("/nonexistent/idem.toml"), "{chain}");
}

#[test]
fn a_config_without_routes_is_warned_about() {
    assert_eq!(parse("[server]\n").unwrap().warnings().len(), 1);
    assert!(parse("[server]\n").unwrap().warnings()[0].contains("no [[routes]]"));
    let c = Config::from_toml_str(EMBEDDED_DEFAULT, Source::Embedded, false).unwrap();
    assert_eq!(c.warnings(), Vec::<String>::new());
}

#[test]
fn responses_api_is_for_openai_providers_only() {
    let with = |kind: &str| {
        parse(&format!(
            "[[providers]]\nname = \"p\"\nkind = \"{kind}\"\nbase_url = \"http://127.0.0.1:1/v1\"\nresponses_api = true\n[[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n"
        ))
    };
    assert!(with("openai").unwrap().providers[0].responses_api);
    for kind in ["anthropic", "azure", "mock"] {
        let err = with(kind).unwrap_err().to_string();
        assert!(err.contains("responses_api"), "{kind}: {err}");
        assert!(err.contains("kind = \"openai\" only"), "{kind}: {err}");
    }
}

#[test]
fn batch_api_is_for_openai_providers_only() {
    let with = |kind: &str, poll: &str| {
        parse(&format!(
            "[[providers]]\nname = \"p\"\nkind = \"{kind}\"\nbase_url = \"http://127.0.0.1:1/v1\"\nbatch_api = true\nbatch_poll_interval = \"{poll}\"\n[[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n"
        ))
    };
    let c = with("openai", "1s").unwrap();
    assert!(c.providers[0].batch_api);
    assert_eq!(c.providers[0].batch_poll_interval, Duration::from_secs(1));
    for kind in ["anthropic", "azure", "mock"] {
        let err = with(kind, "1s").unwrap_err().to_string();
        assert!(err.contains("batch_api"), "{kind}: {err}");
    }
    let err = with("openai", "1ms").unwrap_err().to_string();
    assert!(err.contains("batch_poll_interval"), "{err}");
}

/// A pattern route (`claude-*`) may send the asked name on (`{model}`);
/// only a pattern route may, and a pattern route has no contract (each name
/// it serves is another model, certified on its own).
#[test]
fn pattern_routes_and_the_model_placeholder() {
    let base = "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\n";
    let ok = format!(
        "{base}model = \"claude-*\"\ntargets = [{{ provider = \"p\", model = \"{{model}}\" }}]\n"
    );
    let c = parse(&ok).unwrap();
    assert!(c.routes[0].is_pattern());

    let exact = format!(
        "{base}model = \"claude\"\ntargets = [{{ provider = \"p\", model = \"{{model}}\" }}]\n"
    );
    let e = parse(&exact).unwrap_err().to_string();
    assert!(
        e.contains("routes[0].targets[0].model") && e.contains("{model}"),
        "{e}"
    );

    let contract = format!(
        "{base}model = \"claude-*\"\ncontract = \"c.toml\"\ntargets = [{{ provider = \"p\", model = \"{{model}}\" }}]\n"
    );
    let e = parse(&contract).unwrap_err().to_string();
    assert!(
        e.contains("routes[0].contract") && e.contains("pattern"),
        "{e}"
    );
}

#[test]
fn batches_keep_workers_for_live_jobs_and_a_files_dir_beside_sqlite_only() {
    let base = "[server]\nlisten = \"127.0.0.1:8080\"\n";
    let c = parse(&format!("{base}[jobs]\nworkers = 16\n")).unwrap();
    assert_eq!(c.batches.line_workers(c.jobs.workers), 8, "half by default");
    let c = parse(&format!("{base}[jobs]\nworkers = 1\n")).unwrap();
    assert_eq!(c.batches.line_workers(c.jobs.workers), 1, "at least one");
    for bad in ["workers = 0", "workers = 17"] {
        let e = parse(&format!("{base}[jobs]\nworkers = 16\n[batches]\n{bad}\n")).unwrap_err();
        assert!(e.to_string().contains("batches.workers"), "{e}");
    }
    let dir = "[batches]\nfiles_dir = \"batch-files\"\n";
    let c = parse(&format!("{base}{dir}")).unwrap();
    assert_eq!(
        c.batches.files_dir.as_deref(),
        Some(std::path::Path::new("batch-files"))
    );
    let pg = "[storage]\nurl = \"postgres://127.0.0.1/test\"\n";
    let e = parse(&format!("{base}{pg}{dir}")).unwrap_err();
    assert!(e.to_string().contains("batches.files_dir"), "{e}");
}
