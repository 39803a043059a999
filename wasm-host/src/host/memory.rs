//! Guest memory: reading and writing it safely, and handing bytes to the guest through its allocator,
//! plus the status helpers every host call uses.

use super::VmState;
use crate::abi::Status;
use wasmtime::Caller;

/// Reads guest memory; out of bounds is `InvalidMemoryAccess`, never a host panic.
pub(crate) fn guest_read(
    c: &mut Caller<'_, VmState>,
    ptr: u32,
    len: u32,
) -> Result<Vec<u8>, Status> {
    let mem = c.data().memory.ok_or(Status::InternalFailure)?;
    let data = mem.data(&*c);
    let start = ptr as usize;
    let end = start
        .checked_add(len as usize)
        .ok_or(Status::InvalidMemoryAccess)?;
    data.get(start..end)
        .map(|s| s.to_vec())
        .ok_or(Status::InvalidMemoryAccess)
}

pub(crate) fn guest_write(
    c: &mut Caller<'_, VmState>,
    ptr: u32,
    bytes: &[u8],
) -> Result<(), Status> {
    let mem = c.data().memory.ok_or(Status::InternalFailure)?;
    let data = mem.data_mut(&mut *c);
    let start = ptr as usize;
    let end = start
        .checked_add(bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    data.get_mut(start..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

/// Result of a host call: a status for the guest, or a trap (the guest allocator trapped).
pub(super) type HostResult = wasmtime::Result<i32>;

/// Copies bytes into memory the guest allocated and writes the pointer and size to the guest's out
/// pointers, like proxy-wasm-cpp-host's `copyToPointerSize`: an empty value is a null pointer and size 0.
pub(super) fn return_bytes(
    c: &mut Caller<'_, VmState>,
    bytes: &[u8],
    ptr_ptr: i32,
    size_ptr: i32,
) -> HostResult {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let alloc = c
            .data()
            .allocator
            .clone()
            .ok_or_else(|| wasmtime::format_err!("no guest allocator"))?;
        let Ok(len) = i32::try_from(bytes.len()) else {
            return Ok(Status::InternalFailure.code());
        };
        ptr = alloc.call(&mut *c, len)? as u32;
        if ptr == 0 {
            return Ok(Status::InternalFailure.code());
        }
        if let Err(s) = guest_write(c, ptr, bytes) {
            return Ok(s.code());
        }
    }
    if guest_write(c, ptr_ptr as u32, &ptr.to_le_bytes()).is_err()
        || guest_write(c, size_ptr as u32, &(bytes.len() as u32).to_le_bytes()).is_err()
    {
        c.data_mut().note("out pointer outside guest memory".into());
        return Ok(Status::InvalidMemoryAccess.code());
    }
    Ok(Status::Ok.code())
}

/// Reads `(ptr, len)` from the guest or returns the status the host answers for bad memory.
macro_rules! read_or_status {
    ($c:expr, $ptr:expr, $len:expr) => {
        match $crate::host::memory::guest_read($c, $ptr as u32, $len as u32) {
            Ok(v) => v,
            Err(s) => {
                $c.data_mut()
                    .note(format!("read outside guest memory at {}+{}", $ptr, $len));
                return Ok(s.code());
            }
        }
    };
}
pub(super) use read_or_status;

/// Answers the status a test asked the host to refuse this import with
/// ([`super::Proxy::refuse_host_call`]), doing nothing else: how a proxy refuses a call it does not
/// allow in this phase, or lacks.
macro_rules! refuse_if_asked {
    ($c:expr, $import:literal) => {
        if let Some(s) = $c.data().refusal($import) {
            return Ok(s as i32);
        }
    };
}
pub(super) use refuse_if_asked;

pub(super) fn ok() -> HostResult {
    Ok(Status::Ok.code())
}

pub(super) fn status(s: Status) -> HostResult {
    Ok(s.code())
}
