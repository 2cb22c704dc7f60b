//! Leases: what a live holder renews and a dead one lets lapse (a flight's
//! leader, a job's claim, an attempt). Every holder renews on one rhythm.

use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};

/// The ticks at which a holder renews a lease of length `lease`: every
/// third of it, so two renewals may fail before it lapses. The first is due
/// a third of a lease after now, not at once (the lease was just taken: a
/// renewal then would be a wasted write). A tick missed while the holder
/// was busy is not made up in a burst.
pub fn renewals(lease: Duration) -> Interval {
    let every = lease / 3;
    let mut tick = tokio::time::interval_at(Instant::now() + every, every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn renewals_come_every_third_of_a_lease_from_a_third_on() {
        let start = Instant::now();
        let mut tick = renewals(Duration::from_millis(900));
        tick.tick().await;
        assert_eq!(start.elapsed(), Duration::from_millis(300));
        tick.tick().await;
        assert_eq!(start.elapsed(), Duration::from_millis(600));
    }
}
