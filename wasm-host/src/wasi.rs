//! The slice of WASI preview 1 a Rust `wasm32-wasip1` cdylib imports, written by hand.
//!
//! Why not wasmtime-wasi: the filter needs no files, sockets or real clocks, and a proxy gives it none;
//! pulling in the full WASI stack would add build time and, worse, real time and real randomness, which
//! would make the harness non-deterministic. Here stdout/stderr are captured into the VM's log, both
//! clocks read the harness's virtual clock, `random_get` is a seeded generator, the environment and
//! arguments are empty, `proc_exit` traps (a proxy would tear the VM down), and everything else answers
//! `ENOSYS`/`EBADF` like a sandbox with no preopened directories.

use crate::host::{VmState, guest_read, guest_write};
use wasmtime::{Caller, Linker, Result};

const ERRNO_SUCCESS: i32 = 0;
const ERRNO_BADF: i32 = 8;
const ERRNO_FAULT: i32 = 21;
const ERRNO_INVAL: i32 = 28;
const ERRNO_NOSYS: i32 = 52;

const MODULE: &str = "wasi_snapshot_preview1";

/// Adds the WASI functions to the linker.
pub(crate) fn add_to_linker(linker: &mut Linker<VmState>) -> Result<()> {
    // Kept whole: one registration per WASI function, a flat list.
    linker.func_wrap(
        MODULE,
        "fd_write",
        |mut c: Caller<'_, VmState>, fd: i32, iovs: i32, iovs_len: i32, nwritten: i32| -> i32 {
            if fd != 1 && fd != 2 {
                return ERRNO_BADF;
            }
            let Ok(n) = usize::try_from(iovs_len) else {
                return ERRNO_INVAL;
            };
            let Some(table) = n
                .checked_mul(8)
                .and_then(|len| guest_read(&mut c, iovs as u32, len as u32).ok())
            else {
                return ERRNO_FAULT;
            };
            let mut total = 0u32;
            let mut text = Vec::new();
            for iov in table.chunks_exact(8) {
                let ptr = u32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = u32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                match guest_read(&mut c, ptr, len) {
                    Ok(bytes) => text.extend_from_slice(&bytes),
                    Err(_) => return ERRNO_FAULT,
                }
                total = total.wrapping_add(len);
            }
            c.data_mut().capture_stdio(fd, &text);
            if guest_write(&mut c, nwritten as u32, &total.to_le_bytes()).is_err() {
                return ERRNO_FAULT;
            }
            ERRNO_SUCCESS
        },
    )?;
    linker.func_wrap(
        MODULE,
        "clock_time_get",
        |mut c: Caller<'_, VmState>, _id: i32, _precision: i64, out: i32| -> i32 {
            let now = c.data().now_ns();
            match guest_write(&mut c, out as u32, &now.to_le_bytes()) {
                Ok(()) => ERRNO_SUCCESS,
                Err(_) => ERRNO_FAULT,
            }
        },
    )?;
    linker.func_wrap(
        MODULE,
        "clock_res_get",
        |mut c: Caller<'_, VmState>, _id: i32, out: i32| -> i32 {
            match guest_write(&mut c, out as u32, &1u64.to_le_bytes()) {
                Ok(()) => ERRNO_SUCCESS,
                Err(_) => ERRNO_FAULT,
            }
        },
    )?;
    linker.func_wrap(
        MODULE,
        "random_get",
        |mut c: Caller<'_, VmState>, buf: i32, len: i32| -> i32 {
            let bytes = c.data_mut().random_bytes(len as u32 as usize);
            match guest_write(&mut c, buf as u32, &bytes) {
                Ok(()) => ERRNO_SUCCESS,
                Err(_) => ERRNO_FAULT,
            }
        },
    )?;
    for (name, _) in [("environ_sizes_get", ()), ("args_sizes_get", ())] {
        linker.func_wrap(
            MODULE,
            name,
            |mut c: Caller<'_, VmState>, count: i32, size: i32| -> i32 {
                let ok = guest_write(&mut c, count as u32, &0u32.to_le_bytes()).is_ok()
                    && guest_write(&mut c, size as u32, &0u32.to_le_bytes()).is_ok();
                if ok { ERRNO_SUCCESS } else { ERRNO_FAULT }
            },
        )?;
    }
    for name in ["environ_get", "args_get"] {
        linker.func_wrap(MODULE, name, |_: i32, _: i32| -> i32 { ERRNO_SUCCESS })?;
    }
    linker.func_wrap(
        MODULE,
        "proc_exit",
        |_: Caller<'_, VmState>, code: i32| -> Result<()> {
            Err(wasmtime::format_err!(
                "the filter called proc_exit({code}); a proxy tears the VM down"
            ))
        },
    )?;
    linker.func_wrap(MODULE, "sched_yield", || -> i32 { ERRNO_SUCCESS })?;
    linker.func_wrap(MODULE, "fd_close", |_: i32| -> i32 { ERRNO_BADF })?;
    linker.func_wrap(MODULE, "fd_fdstat_get", |_: i32, _: i32| -> i32 {
        ERRNO_BADF
    })?;
    linker.func_wrap(MODULE, "fd_prestat_get", |_: i32, _: i32| -> i32 {
        ERRNO_BADF
    })?;
    linker.func_wrap(
        MODULE,
        "fd_prestat_dir_name",
        |_: i32, _: i32, _: i32| -> i32 { ERRNO_BADF },
    )?;
    linker.func_wrap(MODULE, "fd_seek", |_: i32, _: i64, _: i32, _: i32| -> i32 {
        ERRNO_BADF
    })?;
    linker.func_wrap(MODULE, "fd_read", |_: i32, _: i32, _: i32, _: i32| -> i32 {
        ERRNO_BADF
    })?;
    linker.func_wrap(
        MODULE,
        "poll_oneoff",
        |_: i32, _: i32, _: i32, _: i32| -> i32 { ERRNO_NOSYS },
    )?;
    Ok(())
}
