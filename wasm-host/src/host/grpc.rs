//! gRPC calls and streams: not offered (ngx_wasm_module has none either); every call answers
//! `Unimplemented`.

use super::{ENV, VmState};
use crate::abi::Status;
use wasmtime::Linker;

/// Links the gRPC calls, all `Unimplemented`.
pub(super) fn add_grpc(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // gRPC is not offered (ngx_wasm_module has none either); Envoy-only filters would get Unimplemented.
    linker.func_wrap(
        ENV,
        "proxy_grpc_call",
        |_: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> i32 { Status::Unimplemented.code() },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_stream",
        |_: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> i32 {
            Status::Unimplemented.code()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_send",
        |_: i32, _: i32, _: i32, _: i32| -> i32 { Status::Unimplemented.code() },
    )?;
    linker.func_wrap(ENV, "proxy_grpc_cancel", |_: i32| -> i32 {
        Status::Unimplemented.code()
    })?;
    linker.func_wrap(ENV, "proxy_grpc_close", |_: i32| -> i32 {
        Status::Unimplemented.code()
    })?;
    Ok(())
}
