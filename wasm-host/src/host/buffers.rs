//! Buffers: `proxy_get_buffer_bytes` and `proxy_set_buffer_bytes` on the request and response bodies
//! (what the filter has buffered), the HTTP-call response body, and the plugin and VM configuration.

use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, return_bytes, status};
use super::{ENV, VmState};
use crate::abi::{BufferType, Status};
use wasmtime::{Caller, Linker};

/// The bytes `range` of a buffer that is not a stream's body (configuration, a call's response).
fn buf_copy(vm: &VmState, kind: BufferType, range: std::ops::Range<usize>) -> Vec<u8> {
    vm.buffer(kind)
        .and_then(|b| b.get(range))
        .unwrap_or(&[])
        .to_vec()
}

impl VmState {
    /// The effective stream's request or response body, taken out of it (None for other buffers).
    fn take_body(&mut self, kind: BufferType) -> Option<Vec<u8>> {
        let s = self.streams.get_mut(&self.effective)?;
        match kind {
            BufferType::RequestBody => Some(std::mem::take(&mut s.request_buffer)),
            BufferType::ResponseBody => Some(std::mem::take(&mut s.response_buffer)),
            _ => None,
        }
    }

    /// Puts back a body [`VmState::take_body`] took.
    fn put_body(&mut self, kind: BufferType, body: Vec<u8>) {
        if let Some(s) = self.streams.get_mut(&self.effective) {
            match kind {
                BufferType::RequestBody => s.request_buffer = body,
                BufferType::ResponseBody => s.response_buffer = body,
                _ => {}
            }
        }
    }

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
            let range = start.min(end)..end;
            if range.is_empty() {
                // proxy-wasm-cpp-host returns Ok without touching the out pointers.
                return ok();
            }
            // A stream's body is lent out of its stream while it is copied into the guest, so
            // that it is copied once, as Envoy copies its buffer into the VM (a copy of it first,
            // to free the borrow, was about 80 us of filter-bench's 131,072-id request).
            let Some(body) = c.data_mut().take_body(kind) else {
                let slice = buf_copy(c.data(), kind, range);
                return return_bytes(&mut c, &slice, ptr_ptr, size_ptr);
            };
            let r = return_bytes(&mut c, &body[range], ptr_ptr, size_ptr);
            c.data_mut().put_body(kind, body);
            r
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
