//! [`RateLog`]: a warning that repeats at most every 10 s, with a count of what it stood for.

use std::time::{Duration, Instant};

/// A warning at most every 10 s, with how many happened since the last one.
#[derive(Debug, Default)]
pub(crate) struct RateLog {
    since: u64,
    last: Option<Instant>,
}

impl RateLog {
    pub(crate) fn note(&mut self, what: &str) {
        self.note_as("connections refused by a limit", what);
    }

    pub(crate) fn note_as(&mut self, head: &str, what: &str) {
        self.since += 1;
        if self.last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(refused = self.since, "{head}: {what}");
            self.since = 0;
            self.last = Some(Instant::now());
        }
    }
}
