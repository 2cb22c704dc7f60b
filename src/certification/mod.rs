//! Certification: which targets of a route may take its work. [`certify`]
//! runs a route's golden cases against a target directly through its
//! provider and records the outcome; [`registry`] copies the latest
//! certifications into each target's slot for the request path;
//! [`failover`] is the one rule the executor and the coalescer ask before
//! sending work to a target. Below it, [`crate::contracts`] is the contract
//! itself and [`crate::routes`] the routes that hold one.

pub mod certify;
pub mod failover;
pub mod registry;
