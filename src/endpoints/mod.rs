//! The endpoints idem serves, as the core sees them: for each API shape,
//! what its upstream call sends and how the answer is read ([`Wire`]), and
//! what it needs of a request beyond the core's task. The core
//! ([`crate::task`], [`crate::flight`]) knows none of these formats; the
//! HTTP faces (`http::openai`, `http::embeddings`) parse requests into
//! tasks with these and render what the core delivers.
//!
//! [`Wire`]: crate::flight::Wire

pub mod chat;
pub mod embeddings;
