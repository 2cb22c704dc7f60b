//! idem: an OpenAI-compatible LLM gateway that does each piece of work once.
//!
//! # Layout
//!
//! The modules follow a request (SPEC section 2):
//!
//! - [`http`]: the router, authentication ([`tenants`]), validation, and the
//!   handlers (`openai`, `jobs`, `ops`), which turn errors into OpenAI error
//!   objects in one place;
//! - [`routes`]: public model names mapped to their ordered targets;
//! - [`jobs`]: idempotency keys, the attempt state machine, the executor and
//!   the reconciler, over the [`store`] (SQLite or PostgreSQL);
//! - [`fingerprint`]: what counts as the same task;
//! - [`cache`]: the result and negative caches;
//! - [`flight`]: one upstream call per fingerprint in flight (leader and
//!   followers);
//! - [`providers`]: the upstream call itself (and each target's circuit
//!   breaker); [`answer`] is what it yields, and [`sse`] converts it between
//!   streamed and plain form;
//! - [`contracts`]: what a route's answers must satisfy, certification, and
//!   the rule that sends failover only to certified targets.
//!
//! Around them: [`config`], [`metrics`], the request log ([`reqlog`]),
//! [`app`] (start-up and shutdown), [`cli`], the [`demo`], [`analyze`] (what
//! a request log says about duplicates, TTL and wait window), and
//! [`mock_upstream`], the test double for providers.

pub mod analyze;
pub mod answer;
pub mod app;
pub mod cache;
pub mod cli;
pub mod config;
pub mod contracts;
pub mod demo;
pub mod fingerprint;
pub mod flight;
pub mod http;
pub mod jobs;
pub mod metrics;
pub mod mock_upstream;
pub mod providers;
pub mod reqlog;
pub mod routes;
pub mod sse;
pub mod store;
pub mod tenants;
