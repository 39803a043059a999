//! Feed polling as configured: how often and how long each replica's feed is polled, how a
//! replica that cannot be reached is backed off and marked stale, how much of an answer is read and
//! how much of it is applied per tick, and where a replica's feed is reached.

use super::{ConfigError, FilterConfig, OutputMode, err};

pub(super) fn d_feed_period() -> u64 {
    200
}
pub(super) fn d_tick() -> u64 {
    100
}
pub(super) fn d_feed_timeout() -> u64 {
    1000
}
pub(super) fn d_feed_backoff_max() -> u64 {
    3_000
}

pub(super) fn d_stale_after() -> u32 {
    3
}
pub(super) fn d_max_events() -> u32 {
    kvsteer_core::feed::DEFAULT_MAX_EVENTS
}
pub(super) fn d_feed_max_bytes() -> usize {
    8 << 20
}
pub(super) fn d_feed_apply_blocks() -> u32 {
    8192
}
pub(super) fn d_feed_apply_us() -> u32 {
    500
}

pub(super) fn d_feed_path_prefix() -> String {
    String::new()
}

impl FilterConfig {
    /// The timer and every feed poller's setting, refused by name.
    pub(super) fn validate_feed_polling(&self) -> Result<(), ConfigError> {
        if self.tick_ms == 0 || self.tick_ms > 60_000 {
            return err(
                "tick_ms",
                format!("must be 1..=60000, got {}", self.tick_ms),
            );
        }
        if self.feed_backoff_max_ms > 3_600_000 {
            return err(
                "feed_backoff_max_ms",
                format!("must be at most 3600000, got {}", self.feed_backoff_max_ms),
            );
        }
        if self.feed_period_ms < self.tick_ms {
            return err(
                "feed_period_ms",
                format!(
                    "must be at least tick_ms ({}), got {}",
                    self.tick_ms, self.feed_period_ms
                ),
            );
        }
        if self.feed_timeout_ms == 0 {
            return err("feed_timeout_ms", "must be positive");
        }
        if self.feed_max_events == 0 {
            return err("feed_max_events", "must be positive");
        }
        if !(kvsteer_core::feed::HEADER_LEN..=1 << 30).contains(&self.feed_max_bytes) {
            return err(
                "feed_max_bytes",
                format!(
                    "must be {}..=1073741824, got {}",
                    kvsteer_core::feed::HEADER_LEN,
                    self.feed_max_bytes
                ),
            );
        }
        if self.feed_apply_blocks_per_tick == 0 {
            return err("feed_apply_blocks_per_tick", "must be positive");
        }
        if self.stale_after_failures == 0 {
            return err("stale_after_failures", "must be positive");
        }
        Ok(())
    }

    /// `:authority` for a replica's feed callout.
    pub fn feed_authority(&self, i: usize) -> &str {
        let r = &self.units[i];
        r.feed_authority.as_deref().unwrap_or(&r.endpoint)
    }

    /// The upstream argument of `dispatch_http_call` for a replica's feed.
    pub fn feed_upstream(&self, i: usize) -> &str {
        let r = &self.units[i];
        match self.output {
            OutputMode::NginxVariable => r.feed_address.as_deref().unwrap_or(&r.endpoint),
            _ => r.feed_cluster.as_deref().unwrap_or(""),
        }
    }
}
