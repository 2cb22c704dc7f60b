//! idem: an OpenAI-compatible LLM gateway that does each piece of work once.
//!
//! # Layout
//!
//! The folders follow a request (SPEC section 2):
//! `http` (auth, validation, handlers) -> `jobs` (idempotency keys, attempts)
//! -> `fingerprint` -> `cache` -> `flight` (one leader per fingerprint)
//! -> `providers` (the upstream call). Around them: `config`, `store`
//! (SQLite and PostgreSQL), `contracts`, `metrics`, and the `mock_upstream`
//! test double for providers.

pub mod config;
pub mod store;
