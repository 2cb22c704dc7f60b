//! The nemesis: faults injected while the fleet runs, on a schedule drawn
//! from the seed, each printed and recorded with its interval.
//!
//! - infrastructure faults, one at a time: SIGKILL a replica then restart it
//!   (on a new port), SIGSTOP a replica past its flight and attempt leases
//!   then SIGCONT it (it comes back with its late answers), stop PostgreSQL
//!   then start it, stop the private Redis then start it;
//! - provider phases, all along: the mock alternates between calm (jittered
//!   latency, so answers come back in another order than the calls went out)
//!   and bursts of 429s with Retry-After, 500s, connection resets, stalls
//!   shorter than the provider timeout, 200s that are no chat completion
//!   (garbage of every kind) and answers past `max_answer_bytes`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::mock_upstream::{Behaviour, Garbage, MockServer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, MAX_ANSWER_BYTES, REPLICAS, calm};
use crate::history::{Fault, FaultKind, Recorder, now_ms};

/// One infrastructure fault of the schedule.
#[derive(Debug, Clone, Copy)]
enum Infra {
    Kill(usize),
    Pause(usize),
    Pg,
    Redis,
}

/// Draws the schedule: `n` faults spread over `run`, in a seeded order that
/// covers every kind when `n >= 4`.
fn schedule(rng: &mut StdRng, n: usize, run: Duration) -> Vec<(Duration, Infra)> {
    let mut kinds: Vec<Infra> = (0..n)
        .map(|i| match i % 5 {
            0 | 4 => Infra::Kill(rng.random_range(0..REPLICAS)),
            3 => Infra::Pause(rng.random_range(0..REPLICAS)),
            1 => Infra::Pg,
            _ => Infra::Redis,
        })
        .collect();
    // Shuffle (Fisher-Yates), so the order differs from seed to seed.
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.random_range(0..=i));
    }
    let slot = run.as_millis() as f64 / (n as f64 + 1.0);
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, k)| {
            let at = slot * (i as f64 + 1.0 + rng.random_range(-0.25..0.25));
            (Duration::from_millis(at as u64), k)
        })
        .collect()
}

fn say(start: Instant, what: &str) {
    println!("chaos: t={:>6.2}s  {what}", start.elapsed().as_secs_f64());
}

/// Runs the infrastructure faults until `run` has passed, then leaves every
/// replica, Redis and PostgreSQL up.
pub async fn infrastructure(
    cluster: &mut Cluster,
    rec: &Recorder,
    seed: u64,
    faults: usize,
    run: Duration,
    start: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e656d65);
    for (at, fault) in schedule(&mut rng, faults, run) {
        if let Some(wait) = at.checked_sub(start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let down = Duration::from_millis(match fault {
            Infra::Pg => rng.random_range(2_000..4_000),
            // Past the flight lease (2 s) and the attempt lease (1 s), and
            // the followers' wait (6 s) on other replicas must not run out.
            Infra::Pause(_) => rng.random_range(2_500..4_000),
            _ => rng.random_range(800..2_500),
        });
        let from_ms = now_ms();
        let kind = match fault {
            Infra::Kill(i) => {
                say(start, &format!("SIGKILL replica {i}"));
                cluster.kill_replica(i).await;
                tokio::time::sleep(down).await;
                cluster.start_replica(i).await;
                let base = cluster.directory.get(i).unwrap_or_default();
                say(start, &format!("replica {i} restarted at {base}"));
                FaultKind::Kill(i)
            }
            Infra::Pause(i) => {
                say(start, &format!("SIGSTOP replica {i}"));
                cluster.signal_replica(i, "STOP");
                tokio::time::sleep(down).await;
                cluster.signal_replica(i, "CONT");
                say(start, &format!("SIGCONT replica {i}"));
                FaultKind::Pause(i)
            }
            Infra::Pg => {
                say(start, "PostgreSQL stopped");
                cluster.pg().down();
                tokio::time::sleep(down).await;
                cluster.pg().up();
                say(start, "PostgreSQL started again");
                FaultKind::PgRestart
            }
            Infra::Redis => {
                say(start, "Redis stopped");
                cluster.redis.down();
                tokio::time::sleep(down).await;
                cluster.redis.up();
                say(start, "Redis started again");
                FaultKind::RedisDown
            }
        };
        rec.fault(Fault {
            kind,
            from_ms,
            until_ms: now_ms(),
        });
    }
    if let Some(wait) = run.checked_sub(start.elapsed()) {
        tokio::time::sleep(wait).await;
    }
    repair(cluster).await;
}

/// Leaves every replica, Redis and PostgreSQL up (the run is over).
pub async fn repair(cluster: &mut Cluster) {
    for i in 0..REPLICAS {
        if !cluster.is_up(i) {
            cluster.start_replica(i).await;
        }
    }
    if !cluster.redis.answers() {
        cluster.redis.up();
    }
    cluster.pg().wait_ready(true);
}

/// The provider phase's name for each kind of garbage, in the order of
/// the kinds drawn in [`provider`].
const GARBAGE_NAMES: [&str; 9] = [
    "garbage: not JSON",
    "garbage: truncated",
    "garbage: empty bodies",
    "garbage: error objects with a 200",
    "garbage: empty choices",
    "garbage: streams without [DONE]",
    "garbage: errors inside streams",
    "garbage: finished streams without [DONE]",
    "garbage: streams with [DONE] but no finish_reason",
];

/// The provider phases, until `stop`.
pub async fn provider(
    mock: Arc<MockServer>,
    rec: Arc<Recorder>,
    seed: u64,
    stop: CancellationToken,
    start: Instant,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x70726f76);
    while !stop.is_cancelled() {
        let (name, b) = match rng.random_range(0..100) {
            0..35 => ("calm", calm()),
            35..48 => (
                "429s with Retry-After: 1",
                Behaviour {
                    fail_status: Some(429),
                    fail_rate: 0.3,
                    retry_after: Some(1),
                    ..calm()
                },
            ),
            48..60 => (
                "500s",
                Behaviour {
                    fail_status: Some(500),
                    fail_rate: 0.25,
                    ..calm()
                },
            ),
            60..72 => (
                "connection resets",
                Behaviour {
                    reset_rate: 0.15,
                    ..calm()
                },
            ),
            72..84 => (
                "stalls of 1.5 s",
                Behaviour {
                    stall_rate: 0.3,
                    stall_ms: 1_500,
                    ..calm()
                },
            ),
            84..92 => {
                let kinds = [
                    Garbage::NotJson,
                    Garbage::Truncated,
                    Garbage::Empty,
                    Garbage::ErrorObject,
                    Garbage::EmptyChoices,
                    Garbage::StreamWithoutDone,
                    Garbage::StreamError,
                    Garbage::FinishedWithoutDone,
                    Garbage::DoneWithoutFinish,
                ];
                let kind = kinds[rng.random_range(0..kinds.len())];
                (
                    GARBAGE_NAMES[kinds.iter().position(|k| *k == kind).unwrap_or(0)],
                    Behaviour {
                        garbage: Some(kind),
                        ..calm()
                    },
                )
            }
            _ => (
                "answers past max_answer_bytes",
                Behaviour {
                    pad_bytes: Some(2 * MAX_ANSWER_BYTES),
                    ..calm()
                },
            ),
        };
        let from_ms = now_ms();
        mock.set_behaviour(b);
        if name != "calm" {
            say(start, &format!("provider: {name}"));
        }
        let phase = Duration::from_millis(rng.random_range(1_500..3_000));
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(phase) => {}
        }
        if name != "calm" {
            rec.fault(Fault {
                kind: FaultKind::Provider(name.to_string()),
                from_ms,
                until_ms: now_ms(),
            });
        }
    }
    mock.set_behaviour(calm());
}
