//! Shared data and shared queues, process-wide across the workers of a [`super::Proxy`]. Shared data
//! follows Envoy's CAS rule (a non-zero CAS that differs from the entry's is `CasMismatch`; a missing
//! entry is `NotFound`; every write gets a fresh non-zero CAS) and is copied on every read. Queues:
//! register, resolve, enqueue, dequeue (`Empty` when there is nothing); `proxy_on_queue_ready` is
//! delivered by [`super::WorkerVm::deliver_queue_ready`].

use super::memory::{
    HostResult, guest_write, ok, read_or_status, refuse_if_asked, return_bytes, status,
};
use super::{ENV, VmState, lock};
use crate::abi::Status;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use wasmtime::{Caller, Linker};

/// A shared queue: registered by one worker's context, which `proxy_on_queue_ready` notifies.
#[derive(Default)]
pub(super) struct SharedQueue {
    vm_id: String,
    name: String,
    pub(super) owner_worker: usize,
    pub(super) owner_context: u32,
    items: VecDeque<Vec<u8>>,
    pub(super) notify: bool,
}

/// Shared data: key -> (value, CAS token).
pub(super) type SharedData = HashMap<Vec<u8>, (Vec<u8>, u32)>;

/// Links the shared-data calls.
pub(super) fn add_shared_data(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: Caller<'_, VmState>,
         kptr: i32,
         klen: i32,
         ptr_ptr: i32,
         size_ptr: i32,
         cas_ptr: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_get_shared_data");
            let key = read_or_status!(&mut c, kptr, klen);
            // Copied on every read, as in Envoy.
            let entry = lock(&c.data().shared().data).get(&key).cloned();
            let Some((value, cas)) = entry else {
                return status(Status::NotFound);
            };
            if guest_write(&mut c, cas_ptr as u32, &cas.to_le_bytes()).is_err() {
                return status(Status::InvalidMemoryAccess);
            }
            return_bytes(&mut c, &value, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: Caller<'_, VmState>,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32,
         cas: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_set_shared_data");
            let key = read_or_status!(&mut c, kptr, klen);
            let value = read_or_status!(&mut c, vptr, vlen);
            let shared = c.data().shared();
            let mut data = lock(&shared.data);
            if cas != 0
                && let Some((_, current)) = data.get(&key)
                && *current != cas as u32
            {
                return status(Status::CasMismatch);
            }
            let next = shared.next_cas.fetch_add(1, Ordering::Relaxed) as u32;
            let next = if next == 0 {
                shared.next_cas.fetch_add(1, Ordering::Relaxed) as u32
            } else {
                next
            };
            data.insert(key, (value, next));
            ok()
        },
    )?;
    Ok(())
}

/// Links the shared-queue calls.
pub(super) fn add_shared_queues(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_register_shared_queue",
        |mut c: Caller<'_, VmState>, nptr: i32, nlen: i32, id_ptr: i32| -> HostResult {
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let (vm_id, worker, ctx) = {
                let st = c.data();
                (st.options.vm_id.clone(), st.worker, st.effective)
            };
            let id = {
                let mut queues = lock(&c.data().shared().queues);
                match queues
                    .iter()
                    .position(|q| q.vm_id == vm_id && q.name == name)
                {
                    Some(i) => {
                        queues[i].owner_worker = worker;
                        queues[i].owner_context = ctx;
                        i + 1
                    }
                    None => {
                        queues.push(SharedQueue {
                            vm_id,
                            name,
                            owner_worker: worker,
                            owner_context: ctx,
                            ..Default::default()
                        });
                        queues.len()
                    }
                }
            };
            match guest_write(&mut c, id_ptr as u32, &(id as u32).to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_resolve_shared_queue",
        |mut c: Caller<'_, VmState>,
         vptr: i32,
         vlen: i32,
         nptr: i32,
         nlen: i32,
         id_ptr: i32|
         -> HostResult {
            let vm_id = String::from_utf8_lossy(&read_or_status!(&mut c, vptr, vlen)).into_owned();
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let found = lock(&c.data().shared().queues)
                .iter()
                .position(|q| q.vm_id == vm_id && q.name == name);
            match found {
                Some(i) => {
                    match guest_write(&mut c, id_ptr as u32, &(i as u32 + 1).to_le_bytes()) {
                        Ok(()) => ok(),
                        Err(s) => status(s),
                    }
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_dequeue_shared_queue",
        |mut c: Caller<'_, VmState>, id: i32, ptr_ptr: i32, size_ptr: i32| -> HostResult {
            let item = {
                let mut queues = lock(&c.data().shared().queues);
                match queues.get_mut((id as u32 as usize).wrapping_sub(1)) {
                    None => return status(Status::NotFound),
                    Some(q) => q.items.pop_front(),
                }
            };
            match item {
                None => status(Status::Empty),
                Some(v) => return_bytes(&mut c, &v, ptr_ptr, size_ptr),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_enqueue_shared_queue",
        |mut c: Caller<'_, VmState>, id: i32, vptr: i32, vlen: i32| -> HostResult {
            let value = read_or_status!(&mut c, vptr, vlen);
            let mut queues = lock(&c.data().shared().queues);
            match queues.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(q) => {
                    q.items.push_back(value);
                    q.notify = true;
                    ok()
                }
            }
        },
    )?;
    Ok(())
}
