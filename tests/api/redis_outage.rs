//! While Redis does not answer, requests keep their latency: each replica
//! gives up on Redis after `redis_timeout` and coalesces locally.

use std::time::{Duration, Instant};

use crate::helpers::*;
use crate::replicas::{Cluster, PrivateRedis};

fn signal(redis: &PrivateRedis, sig: &str) {
    let pid = redis.child.as_ref().unwrap().id();
    let ok = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_redis_hangs_a_request_waits_about_the_redis_timeout_not_longer() {
    let redis = PrivateRedis::start();
    // The default redis_timeout: 250 ms.
    let c = Cluster::start_with(2, Spec::default(), &redis.url(), |_| {
        vec![("IDEM_COALESCING__REDIS_TIMEOUT", "250ms")]
    })
    .await;
    let warm = collect(c.fire(&[0, 1], &chat_body("warm"), 2)).await;
    assert!(warm.iter().all(|(s, _, _)| *s == 200));
    // Redis accepts connections and commands but answers nothing.
    signal(&redis, "STOP");
    let mut worst = Duration::ZERO;
    for i in 0..8 {
        let started = Instant::now();
        let r = collect(c.fire(&[0, 1], &chat_body(&format!("while Redis hangs {i}")), 6)).await;
        worst = worst.max(started.elapsed());
        assert!(r.iter().all(|(s, _, _)| *s == 200), "{r:?}");
    }
    signal(&redis, "CONT");
    assert!(
        worst < Duration::from_millis(1_500),
        "a wave took {worst:?} while Redis hung (redis_timeout 250 ms)"
    );
}
