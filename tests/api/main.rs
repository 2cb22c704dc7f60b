//! Integration tests: the real idem gateway on port 0, spoken to over HTTP
//! the way a client does, against the real store and mock providers.
//! One test binary (`cargo test --test api`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod analyze;
mod batches;
mod bounds;
mod budgets;
mod coalescing;
mod contracts;
mod dashboard;
mod embeddings;
mod faces;
mod files;
mod first_hour;
mod forwarding;
mod garbage;
mod gateway;
mod helpers;
mod hostile;
mod jobs;
mod keys;
mod message_batches;
mod native;
mod ops;
mod patterns;
mod private_services;
mod probes;
mod provenance;
mod providers;
mod readme;
mod redis_cluster;
mod redis_outage;
mod reload;
mod rendering;
mod replicas;
mod savings;
#[path = "../support/services.rs"]
mod services;
mod smuggling;
mod takeover;
mod traces;
mod ways;
