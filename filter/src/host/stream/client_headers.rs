//! The request headers a client must not set: copies of the routing and DP-rank headers (a client
//! never chooses a replica) and an untrusted priority header (nor its own class) are removed before
//! the request goes upstream; a trusted priority header's class is read.

use super::Stream;
use crate::host::abi;
use crate::host::metrics::inc;
use crate::host::vm::{Shared, log};
use proxy_wasm::types::{Action, LogLevel, MapType};

impl Stream {
    /// The priority header (`routing.admission.priority_header`): a trusted one's class is kept for
    /// admission; an untrusted copy is removed before the request goes upstream and counted, so a
    /// client can neither raise its own priority nor pass the header on. Every value is hostile:
    /// only a bounded comparison with the three class names reads it. `Some`: the header that could
    /// not be removed.
    fn read_priority_header(
        &mut self,
        state: &mut crate::worker::WorkerState,
    ) -> Option<(String, u32)> {
        let adm = state.admission()?;
        let name = adm.priority_header()?;
        let map = MapType::HttpRequestHeaders;
        let present = abi::get_header(map, name);
        if adm.trusts_header() {
            if let Ok(Some(v)) = present {
                self.header_class = adm.header_class(&v);
            }
            return None;
        }
        if matches!(present, Ok(None)) {
            return None;
        }
        match abi::remove_header(map, name) {
            Ok(()) => {
                if present.is_ok() {
                    state.priority_header_removed();
                }
                None
            }
            Err(e) => Some((name.to_string(), e)),
        }
    }

    /// Clients must never choose a replica: drops any copy of the routing header they sent, on every
    /// request, routed or not, and of the rank header (nor a DP rank). `Err`: the action for a
    /// request refused because a copy could not be removed.
    pub(super) fn remove_client_routing_headers(&mut self, vm: &Shared) -> Result<(), Action> {
        // Clients must never choose a replica: drop any copy of the routing header they sent,
        // on every request, routed or not. (The header names are borrowed from the VM's
        // configuration; host calls never re-enter the VM, so the borrow is safe across them.)
        let mut vm = vm.borrow_mut();
        let vm = &mut vm.pools[self.pool];
        // The rank header too: a client must not pick a DP rank either.
        let mut removed = 0;
        let mut stuck = None;
        let map = MapType::HttpRequestHeaders;
        for name in [vm.state.routing_header(), vm.state.rank_header()] {
            let present = abi::get_header(map, name);
            if matches!(present, Ok(None)) {
                continue;
            }
            // Present, or the host would not say: remove it either way.
            match abi::remove_header(map, name) {
                Ok(()) => removed += present.is_ok() as usize,
                Err(e) => stuck = Some((name.to_string(), e)),
            }
        }
        for _ in 0..removed {
            vm.state.spoofed_header_removed();
            inc(vm.metrics.spoofed, 1);
        }
        if stuck.is_none() {
            stuck = self.read_priority_header(&mut vm.state);
        }
        if let Some((name, e)) = stuck {
            // A client's copy that cannot be removed must not reach the proxy's balancer.
            log(
                LogLevel::Warn,
                &format!(
                    "kvsteer: could not remove the client's {name} header (status {e}); request refused"
                ),
            );
            return Err(self.refuse(
                500,
                "internal_error",
                &format!("kvsteer: the request's {name} header could not be removed"),
            ));
        }
        Ok(())
    }
}
