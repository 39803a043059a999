//! Buffers: `proxy_get_buffer_bytes` and `proxy_set_buffer_bytes` on the request and response bodies
//! (what the filter has buffered), the HTTP-call response body, and the plugin and VM configuration.

use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, return_bytes, status};
use super::{ENV, VmState};
use crate::abi::{BufferType, Status};
use wasmtime::{Caller, Linker};

impl VmState {
    fn buffer(&self, buf: BufferType) -> Option<&[u8]> {
        match buf {
            BufferType::RequestBody => self
                .streams
                .get(&self.effective)
                .map(|s| s.request_buffer.as_slice()),
            BufferType::ResponseBody => self
                .streams
                .get(&self.effective)
                .map(|s| s.response_buffer.as_slice()),
            BufferType::HttpCallResponseBody => self.call_response.as_ref()?.body.as_deref(),
            BufferType::PluginConfiguration => Some(&self.options.plugin_config),
            BufferType::VmConfiguration => Some(&self.options.vm_config),
            _ => None,
        }
    }
}

/// Links the buffer calls.
pub(super) fn add_buffers(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, VmState>,
         kind: i32,
         start: i32,
         max: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_get_buffer_bytes");
            let Some(kind) = BufferType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let Some(buf) = c.data().buffer(kind) else {
                return status(Status::NotFound);
            };
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            if start.checked_add(max).is_none() {
                return status(Status::BadArgument);
            }
            let end = (start + max).min(buf.len());
            let slice = buf.get(start.min(end)..end).unwrap_or(&[]).to_vec();
            if slice.is_empty() {
                // proxy-wasm-cpp-host returns Ok without touching the out pointers.
                return ok();
            }
            return_bytes(&mut c, &slice, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, VmState>,
         kind: i32,
         start: i32,
         size: i32,
         ptr: i32,
         len: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_set_buffer_bytes");
            let data = read_or_status!(&mut c, ptr, len);
            let (start, size) = (start as u32 as usize, size as u32 as usize);
            let Some(kind) = BufferType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let Some(s) = c.data_mut().stream_mut() else {
                return status(Status::NotFound);
            };
            let buf = match kind {
                BufferType::RequestBody => &mut s.request_buffer,
                BufferType::ResponseBody => &mut s.response_buffer,
                _ => return status(Status::BadArgument),
            };
            // Envoy's Buffer::copyFrom: start 0 drains `size` bytes and prepends; start at or past the
            // end appends; anything in between is refused.
            if start == 0 {
                let drain = size.min(buf.len());
                buf.drain(..drain);
                buf.splice(0..0, data);
            } else if start >= buf.len() {
                buf.extend_from_slice(&data);
            } else {
                return status(Status::BadArgument);
            }
            ok()
        },
    )?;
    Ok(())
}
