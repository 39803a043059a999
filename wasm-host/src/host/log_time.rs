//! Logging and time: `proxy_log`, `proxy_get_log_level`, `proxy_get_current_time_nanoseconds`,
//! `proxy_set_tick_period_milliseconds`. Log lines are kept per worker (the first 20,000, with counts
//! per level); the clock is the proxy's virtual clock on a 2026-01-01 base.

use super::memory::{HostResult, guest_write, ok, read_or_status, refuse_if_asked, status};
use super::{CLOCK_BASE_NS, ENV, FUEL_PER_CALLBACK, VmState};
use crate::abi::{LogLevel, Status};
use std::sync::atomic::Ordering;
use wasmtime::{Caller, Linker};

/// Log lines kept per worker (counts are kept for all).
const LOG_KEEP: usize = 20_000;

/// A log line the filter wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub worker: usize,
    pub context: u32,
    pub level: LogLevel,
    pub message: String,
}

impl VmState {
    pub(crate) fn now_ns(&self) -> u64 {
        CLOCK_BASE_NS
            + self
                .shared
                .as_ref()
                .map_or(0, |s| s.clock_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn capture_stdio(&mut self, fd: i32, bytes: &[u8]) {
        let slot = if fd == 1 { 0 } else { 1 };
        self.stdio[slot].extend_from_slice(bytes);
        while let Some(pos) = self.stdio[slot].iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.stdio[slot].drain(..=pos).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let level = if fd == 1 {
                LogLevel::Info
            } else {
                LogLevel::Error
            };
            self.push_log(level, format!("[fd {fd}] {text}"));
        }
    }

    fn push_log(&mut self, level: LogLevel, message: String) {
        self.log_counts[level as usize] += 1;
        if level == LogLevel::Critical {
            self.last_critical = Some(message.clone());
        }
        if self.options.echo_logs {
            eprintln!(
                "[wasm w{} c{} {:?}] {}",
                self.worker, self.effective, level, message
            );
        }
        if self.logs.len() < LOG_KEEP {
            self.logs.push(LogLine {
                worker: self.worker,
                context: self.effective,
                level,
                message,
            });
        }
    }
}

/// Links logging, the clock and the tick period.
pub(super) fn add_log_time(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_log",
        |mut c: Caller<'_, VmState>, level: i32, ptr: i32, len: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_log");
            let msg = read_or_status!(&mut c, ptr, len);
            let Some(level) = LogLevel::from_raw(level) else {
                c.data_mut().note(format!("proxy_log with level {level}"));
                return status(Status::BadArgument);
            };
            let msg = String::from_utf8_lossy(&msg).into_owned();
            c.data_mut().push_log(level, msg);
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_log_level",
        |mut c: Caller<'_, VmState>, out: i32| -> HostResult {
            let level = c.data().options.log_level as u32;
            match guest_write(&mut c, out as u32, &level.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, VmState>, out: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_get_current_time_nanoseconds");
            let mut now = c.data().now_ns();
            let per_fuel = c.data().options.clock_ns_per_fuel;
            if per_fuel > 0
                && let Ok(left) = c.get_fuel()
            {
                now += FUEL_PER_CALLBACK
                    .saturating_sub(left)
                    .saturating_mul(per_fuel);
            }
            match guest_write(&mut c, out as u32, &now.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, VmState>, period: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_set_tick_period_milliseconds");
            c.data_mut().tick_period_ms = period as u32;
            ok()
        },
    )?;
    Ok(())
}
