//! Contexts and foreign functions: `proxy_set_effective_context` (known contexts only), `proxy_done`,
//! and `proxy_call_foreign_function` (`clear_route_cache` in Envoy mode, otherwise `NotFound`).

use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, status};
use super::{ENV, HostMode, ROOT_CONTEXT, VmState};
use crate::abi::Status;
use wasmtime::{Caller, Linker};

/// Links the context and foreign-function calls.
pub(super) fn add_context(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: Caller<'_, VmState>, ctx: i32| -> HostResult {
            let st = c.data_mut();
            let ctx = ctx as u32;
            if ctx == ROOT_CONTEXT || st.streams.contains_key(&ctx) {
                st.effective = ctx;
                ok()
            } else {
                status(Status::BadArgument)
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_done",
        |mut c: Caller<'_, VmState>| -> HostResult {
            c.data_mut().done_called = true;
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: Caller<'_, VmState>,
         nptr: i32,
         nlen: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_call_foreign_function");
            let name = read_or_status!(&mut c, nptr, nlen);
            // Envoy registers `clear_route_cache` (re-run route selection after a header changed);
            // nginx has no foreign functions.
            if name == b"clear_route_cache" && c.data().options.mode == HostMode::Envoy {
                if let Some(s) = c.data_mut().stream_mut() {
                    s.route_cache_cleared = true;
                }
                return ok();
            }
            status(Status::NotFound)
        },
    )?;
    Ok(())
}
