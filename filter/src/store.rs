//! The slice of the proxy's shared-data API the filter uses, as a trait, so that everything built on
//! shared data (the feed lease and relay in [`crate::relay`], the worker numbers and load records in
//! [`crate::peers`]) runs natively in unit tests against an in-memory store. The proxy's own shared
//! data is `HostStore` in the proxy-wasm contexts.

/// Envoy's `get/set_shared_data`: process-wide bytes under string keys, each write checked against a
/// CAS token when one is given.
pub trait SharedStore {
    /// Value and CAS token; `None` when absent or unavailable.
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes the value; with `cas`, only if the entry is unchanged since it was read. `false` when the
    /// write did not happen.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::SharedStore;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// In-memory stand-in for the proxy's shared data, with Envoy's CAS rule.
    #[derive(Default)]
    pub struct MemStore(pub RefCell<HashMap<String, (Vec<u8>, u32)>>);

    impl SharedStore for MemStore {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.0.borrow().get(key).cloned()
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let mut m = self.0.borrow_mut();
            let next = match (m.get(key), cas) {
                (Some((_, c)), Some(want)) if *c != want => return false,
                (Some((_, c)), _) => c + 1,
                (None, _) => 1,
            };
            m.insert(key.to_string(), (value.to_vec(), next));
            true
        }
    }
}
