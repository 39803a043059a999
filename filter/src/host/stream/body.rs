//! The request body while the filter holds it: read slice by slice as it arrives for the early scan
//! (docs/design/filter.md, "The body as it arrives"), counted against the VM's shares for held bodies
//! (`early_body_scan_max_bytes`, `body_hold_max_bytes`), and taken whole once it has all arrived.

use super::Stream;
use crate::host::abi;
use crate::host::metrics::inc;
use crate::host::vm::Shared;
use crate::worker::BodyFallback;
use proxy_wasm::types::{Action, BufferType};

impl Stream {
    /// Reads the slice of the body that arrived since the last call (the host's buffer holds
    /// `body_size` bytes so far, from the start), lets the early scan go on, and drops what the scan
    /// will not look at again. Anything inconsistent (a buffer shorter than what was read, a host
    /// error, fewer bytes than asked) or the VM's share for held bodies spent turns the early
    /// reading off for this request: the body is then read whole at the end, as without the scan.
    pub(super) fn read_arrived(&mut self, body_size: usize) {
        let (Some(vm), Some(scan)) = (self.vm.clone(), self.early.as_ref()) else {
            return;
        };
        if !scan.is_on() {
            // Nothing the scan follows: reading more would buy nothing.
            return self.drop_arrived();
        }
        let have = self.seen;
        if body_size == have || scan.keep_from() == usize::MAX {
            // Nothing new, or the prompt's array closed: the rest is for the final read.
            return;
        }
        let want = body_size.saturating_sub(have);
        let slice = match abi::get_buffer(BufferType::HttpRequestBody, have, want) {
            Ok(Some(slice)) if body_size > have && slice.len() == want => slice,
            _ => return self.drop_arrived(),
        };
        if self.arrived.is_empty() {
            self.base = have;
            self.arrived = slice;
        } else {
            self.arrived.extend_from_slice(&slice);
        }
        self.seen = body_size;
        if !self.count_held(&vm) {
            return self.drop_arrived();
        }
        let Some(scan) = self.early.as_mut() else {
            return;
        };
        scan.advance_window(self.base, &self.arrived);
        // Drop what the scan has read: it never looks before `keep_from` again.
        let keep = scan.keep_from().min(self.seen);
        if keep > self.base {
            self.arrived.drain(..keep - self.base);
            self.base = keep;
        }
        if self.arrived.capacity() > 2 * self.arrived.len() + (64 << 10) {
            self.arrived.shrink_to(2 * self.arrived.len());
        }
        self.count_held(&vm);
    }

    /// Counts `arrived`'s capacity in the VM's share for the early scan; false (nothing counted
    /// beyond what was) when it would pass `early_body_scan_max_bytes`, counted as declined.
    fn count_held(&mut self, vm: &Shared) -> bool {
        let capacity = self.arrived.capacity();
        let mut vm = vm.borrow_mut();
        let others = vm.early_held.saturating_sub(self.held);
        if others + capacity > vm.pools[self.pool].state.config().early_body_scan_max_bytes {
            inc(vm.pools[self.pool].metrics.early_declined, 1);
            return false;
        }
        vm.early_held = others + capacity;
        self.held = capacity;
        true
    }

    /// Gives up the early reading of this request's body (the body is read whole at the end) and
    /// returns its buffer's share to the VM.
    pub(super) fn drop_arrived(&mut self) {
        self.early = None;
        self.arrived = Vec::new();
        self.return_held();
    }

    fn return_held(&mut self) {
        if self.held > 0
            && let Some(vm) = &self.vm
            && let Ok(mut vm) = vm.try_borrow_mut()
        {
            vm.early_held = vm.early_held.saturating_sub(self.held);
            self.held = 0;
        }
    }

    /// Counts `bytes` of this body as held by the proxy for the filter (`body_hold_max_bytes`,
    /// all the VM's streams together); false, with nothing more counted, when that would pass the
    /// bound.
    pub(super) fn count_hold(&mut self, bytes: usize) -> bool {
        let Some(vm) = &self.vm else {
            return true;
        };
        let mut vm = vm.borrow_mut();
        let others = vm.body_held.saturating_sub(self.hold);
        let bytes = bytes.max(self.declared);
        if others.saturating_add(bytes) > vm.pools[self.pool].state.config().body_hold_max_bytes {
            return false;
        }
        vm.body_held = others + bytes;
        self.hold = bytes;
        true
    }

    /// Returns this stream's share of the VM's held bodies: the filter holds its body no more.
    pub(super) fn return_hold(&mut self) {
        if self.hold > 0
            && let Some(vm) = &self.vm
            && let Ok(mut vm) = vm.try_borrow_mut()
        {
            vm.body_held = vm.body_held.saturating_sub(self.hold);
            self.hold = 0;
        }
    }

    /// Routes by load, its body unread, a stream whose body would pass `body_hold_max_bytes` (in a
    /// P/D fleet, where an unread body is never forwarded, refused with a 503), counted; the proxy
    /// then lets the body flow on. `bytes`: what the body is known to hold.
    pub(super) fn route_over_hold(&mut self, bytes: usize) -> Action {
        self.drop_arrived();
        self.return_hold();
        if let Some(vm) = &self.vm {
            let vm = vm.borrow();
            inc(vm.pools[self.pool].metrics.body_hold_fallbacks, 1);
        }
        if self
            .vm
            .as_ref()
            .is_some_and(|vm| vm.borrow().pools[self.pool].state.disaggregated())
        {
            return self.refuse_unread_pd(503, "the proxy holds as many request bodies as allowed");
        }
        self.route_fallback(BodyFallback::HoldLimit, bytes)
    }

    /// The whole request body, up to `max` bytes, read from the proxy's buffer (what
    /// [`Stream::read_arrived`] read was dropped as the scan went). A buffer shorter than what the
    /// scan saw turns the scan's work off for this body.
    pub(super) fn take_body(&mut self, max: usize) -> Result<Vec<u8>, u32> {
        self.arrived = Vec::new();
        self.return_held();
        self.return_hold();
        let body = abi::get_buffer(BufferType::HttpRequestBody, 0, max)?.unwrap_or_default();
        if body.len() < self.seen {
            self.early = None;
        }
        Ok(body)
    }
}
