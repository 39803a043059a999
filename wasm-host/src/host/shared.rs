//! Shared data and shared queues, process-wide across the workers of a [`super::Proxy`]. Shared data
//! follows Envoy's CAS rule (a non-zero CAS that differs from the entry's is `CasMismatch`; a missing
//! entry is `NotFound`; every write gets a fresh non-zero CAS) and is copied on every read. In nginx
//! mode it follows ngx_wasm_module's `shm_kv` instead ([`ShmZone`]): the CAS must equal the entry's,
//! 0 standing for "no entry" (so a write without one creates a key but never replaces it), each
//! entry's CAS counts its writes from 1, and a zone that is full evicts entries. Queues:
//! register, resolve, enqueue, dequeue (`Empty` when there is nothing); `proxy_on_queue_ready` is
//! delivered by [`super::WorkerVm::deliver_queue_ready`].

use super::memory::{
    HostResult, guest_write, ok, read_or_status, refuse_if_asked, return_bytes, status,
};
use super::{ENV, HostMode, VmState, lock};
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

/// The bookkeeping of ngx_wasm_module's `shm_kv` zone (nginx mode): what each entry takes of the
/// zone, and how recently it was read or written. The module keeps entries in nginx's slab allocator
/// and, with its default `eviction=slru`, one least-recently-used queue per slab size class: a write
/// that finds no room expires the oldest entry of its own class, else of the next larger class that
/// has one, else of the largest smaller one, and tries again. Modelled here by size: an entry takes
/// its node (key, value and the module's per-entry header) rounded up to nginx's slot size (a power
/// of two up to half a page, whole pages above), and the zone is full when their sum would pass its
/// size. nginx's pages are dedicated to one slot size, so a real zone fills a little earlier.
#[derive(Default)]
pub(super) struct ShmZone {
    used: usize,
    clock: u64,
    /// key -> (bytes taken, last use).
    entries: HashMap<Vec<u8>, (usize, u64)>,
    pub(super) evictions: u64,
}

/// The module's per-entry header (an rbtree node, a queue link, the key and value descriptors and
/// the CAS) on 64-bit nginx.
const SHM_NODE_HEADER: usize = 96;
const SHM_PAGE: usize = 4096;

impl ShmZone {
    /// Bytes an entry with this key and value takes of the zone.
    fn footprint(key: usize, value: usize) -> usize {
        let n = SHM_NODE_HEADER + key + value;
        if n > SHM_PAGE / 2 {
            n.div_ceil(SHM_PAGE) * SHM_PAGE
        } else {
            n.next_power_of_two().max(8)
        }
    }

    /// The slab size class of an entry of `bytes` (rounded) size: every entry over half a page
    /// shares the last one.
    fn class(bytes: usize) -> u32 {
        bytes.min(SHM_PAGE).trailing_zeros()
    }

    fn touch(&mut self, key: &[u8]) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(key) {
            e.1 = self.clock;
        }
    }

    /// Makes room for `key`'s new value in a zone of `capacity` bytes, evicting from `data` as the
    /// module does; `false` when even an empty zone could not hold it.
    fn make_room(
        &mut self,
        data: &mut SharedData,
        key: &[u8],
        value_len: usize,
        capacity: usize,
    ) -> bool {
        let need = Self::footprint(key.len(), value_len);
        let had = self.entries.get(key).map_or(0, |e| e.0);
        let want = Self::class(need);
        while self.used - had + need > capacity {
            // The oldest entry of the lowest class at or above the write's, else of the highest
            // below it (never the entry being written).
            let victim = self
                .entries
                .iter()
                .filter(|(k, _)| k.as_slice() != key)
                .map(|(k, &(bytes, used))| (Self::class(bytes), used, k))
                .min_by_key(|&(class, used, _)| {
                    let rank = if class >= want {
                        (0, class)
                    } else {
                        (1, u32::MAX - class)
                    };
                    (rank, used)
                })
                .map(|(_, _, k)| k.clone());
            let Some(victim) = victim else {
                return false;
            };
            if let Some((bytes, _)) = self.entries.remove(&victim) {
                self.used -= bytes;
            }
            data.remove(&victim);
            self.evictions += 1;
        }
        self.clock += 1;
        self.used = self.used - had + need;
        self.entries.insert(key.to_vec(), (need, self.clock));
        true
    }
}

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
            if entry.is_some() && c.data().options.mode == HostMode::Nginx {
                lock(&c.data().shared().zone).touch(&key);
            }
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
            if c.data().options.mode == HostMode::Nginx {
                let current = data.get(&key).map_or(0, |(_, cas)| *cas);
                if cas as u32 != current {
                    return status(Status::CasMismatch);
                }
                let capacity = c.data().options.nginx.shm_kv_bytes;
                let mut zone = lock(&shared.zone);
                if !zone.make_room(&mut data, &key, value.len(), capacity) {
                    // The module logs "no memory" and fails the call.
                    return status(Status::InternalFailure);
                }
                data.insert(key, (value, current.wrapping_add(1).max(1)));
                return ok();
            }
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
    // Kept whole: one registration per shared-queue host function, a flat list.
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

#[cfg(test)]
mod tests {
    use super::{SharedData, ShmZone};

    fn put(zone: &mut ShmZone, data: &mut SharedData, key: &str, len: usize) -> bool {
        let ok = zone.make_room(data, key.as_bytes(), len, 1024);
        if ok {
            data.insert(key.as_bytes().to_vec(), (vec![0; len], 1));
        }
        ok
    }

    #[test]
    fn a_full_zone_evicts_the_oldest_entry_of_the_written_size_class_first() {
        let (mut zone, mut data) = (ShmZone::default(), SharedData::new());
        // Four 256-byte slots (header + key + 100 bytes) fill a 1 KiB zone.
        for k in ["a", "b", "c", "d"] {
            assert!(put(&mut zone, &mut data, k, 100));
        }
        assert_eq!(zone.evictions, 0);
        zone.touch(b"a");
        assert!(put(&mut zone, &mut data, "e", 100));
        assert!(
            !data.contains_key(b"b".as_slice()),
            "b was the least recently used"
        );
        assert!(data.contains_key(b"a".as_slice()), "a was read since");
        // A smaller entry (a 128-byte slot) takes the oldest of the next larger class with one.
        assert!(put(&mut zone, &mut data, "f", 10));
        assert!(!data.contains_key(b"c".as_slice()));
        assert_eq!(zone.evictions, 2);
        // Rewriting a key in place needs no room beyond its own.
        assert!(put(&mut zone, &mut data, "a", 100));
        assert_eq!(zone.evictions, 2);
        // One that cannot fit even alone empties the zone and fails, as the module's write does.
        assert!(!put(&mut zone, &mut data, "g", 3000));
        assert_eq!(data.len(), 0);
    }
}
