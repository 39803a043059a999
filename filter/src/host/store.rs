//! The slice of the proxy's shared-data API the filter uses, as a trait, so that everything built on
//! shared data (the feed lease and relay in [`crate::worker::relay`], the worker numbers and load records in
//! [`crate::worker::share`]) runs natively in unit tests against an in-memory store. The proxy's own shared
//! data is `HostStore`, here too, built for the wasm target only.

/// Tries of [`SharedStore::overwrite`] before it gives up: each lost try means another worker wrote
/// the same key between the read and the write, which for the records written this way (each has one
/// writer at a time) takes a lease changing hands, so two or three tries are the most ever needed.
pub const OVERWRITE_TRIES: u32 = 8;

/// The proxy's `get/set_shared_data`: process-wide bytes under string keys, each write checked against
/// a CAS token when one is given.
///
/// The hosts differ on a write without a token (CAS 0): Envoy writes whatever the entry holds, while
/// ngx_wasm_module writes only a key that does not exist yet (its rule is "the token must equal the
/// entry's, 0 for no entry"). So a record that is written again and again (a relay slot, a worker's
/// load) goes through [`SharedStore::overwrite`], which holds on both; `set` with `None` is for keys
/// that must not be overwritten, or where a lost write is harmless.
pub trait SharedStore {
    /// Value and CAS token; `None` when absent or unavailable.
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes the value; with `cas`, only if the entry is unchanged since it was read (without, on
    /// ngx_wasm_module, only if there is no entry). `false` when the write did not happen.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
    /// Replaces the entry's value whatever it holds (last writer wins): reads its token and writes
    /// with it, again when another worker wrote in between, at most [`OVERWRITE_TRIES`] times.
    /// `false` when every try lost or the store refused the write.
    fn overwrite(&self, key: &str, value: &[u8]) -> bool {
        overwrite_by_cas(self, key, value)
    }
}

/// [`SharedStore::overwrite`] as the read-then-write loop, for stores that override it on hosts
/// where a write without a token already replaces the entry.
pub fn overwrite_by_cas<S: SharedStore + ?Sized>(store: &S, key: &str, value: &[u8]) -> bool {
    (0..OVERWRITE_TRIES).any(|_| {
        let cas = store.get(key).map(|(_, cas)| cas);
        store.set(key, value, cas)
    })
}

/// The proxy's own shared data (only in the wasm build, where the host exists).
#[cfg(target_arch = "wasm32")]
mod proxy {
    use super::{SharedStore, overwrite_by_cas};
    use crate::config::{FilterConfig, OutputMode};

    /// The proxy's shared data, for the feed lease and relay, worker numbers and shared load. A read the
    /// proxy refuses reads as absent and a refused write did not happen ([`SharedStore`]'s "absent or
    /// unavailable" and `false`), as a lost CAS race does: the lease, relay and peer records already
    /// treat both as normal (another worker got there first, or nothing is shared yet).
    pub(crate) struct HostStore {
        /// The host writes a key without a CAS token only if it does not exist yet (ngx_wasm_module),
        /// so a record is replaced by reading its token first ([`SharedStore::overwrite`]). Envoy writes
        /// such a key whatever it holds, in one call, as the filter always has there.
        cas_zero_creates: bool,
    }

    static ENVOY_STORE: HostStore = HostStore {
        cas_zero_creates: false,
    };
    static NGX_STORE: HostStore = HostStore {
        cas_zero_creates: true,
    };

    /// The shared data of the proxy this configuration is for (nginx mode: ngx_wasm_module's CAS rule).
    pub(crate) fn host_store(cfg: &FilterConfig) -> &'static HostStore {
        if cfg.output == OutputMode::NginxVariable {
            &NGX_STORE
        } else {
            &ENVOY_STORE
        }
    }

    impl SharedStore for HostStore {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            crate::host::abi::get_shared_data(key).ok().flatten()
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            matches!(crate::host::abi::set_shared_data(key, value, cas), Ok(true))
        }
        fn overwrite(&self, key: &str, value: &[u8]) -> bool {
            if self.cas_zero_creates {
                overwrite_by_cas(self, key, value)
            } else {
                self.set(key, value, None)
            }
        }
    }
}
#[cfg(target_arch = "wasm32")]
pub(crate) use proxy::host_store;

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

    /// In-memory stand-in with ngx_wasm_module's CAS rule: the token must equal the entry's, and
    /// no token (0) writes only a key that does not exist yet.
    #[derive(Default)]
    pub struct NgxStore(pub RefCell<HashMap<String, (Vec<u8>, u32)>>);

    impl SharedStore for NgxStore {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.0.borrow().get(key).cloned()
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let mut m = self.0.borrow_mut();
            let current = m.get(key).map_or(0, |(_, c)| *c);
            if cas.unwrap_or(0) != current {
                return false;
            }
            m.insert(
                key.to_string(),
                (value.to_vec(), current.wrapping_add(1).max(1)),
            );
            true
        }
    }

    /// A store whose first `losses` writes lose a race: another worker writes the key in between.
    struct Racy {
        inner: NgxStore,
        losses: std::cell::Cell<u32>,
    }

    impl SharedStore for Racy {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            if self.losses.get() > 0 {
                self.losses.set(self.losses.get() - 1);
                let other = self.inner.get(key).map(|(_, c)| c);
                assert!(self.inner.set(key, b"other worker", other));
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn overwrite_replaces_under_both_cas_rules() {
        let envoy = MemStore::default();
        let ngx = NgxStore::default();
        for s in [&envoy as &dyn SharedStore, &ngx] {
            assert!(s.overwrite("k", b"one"));
            assert!(s.overwrite("k", b"two"));
            assert_eq!(s.get("k").map(|(v, _)| v), Some(b"two".to_vec()));
        }
        // What a write without a token does on nginx: the first lands, the next never.
        assert!(!ngx.set("k", b"three", None));
        assert_eq!(ngx.get("k").map(|(v, _)| v), Some(b"two".to_vec()));
    }

    #[test]
    fn overwrite_retries_a_lost_race_and_gives_up() {
        let s = Racy {
            inner: NgxStore::default(),
            losses: std::cell::Cell::new(3),
        };
        assert!(s.overwrite("k", b"mine"), "lost 3 times, then won");
        assert_eq!(s.get("k").map(|(v, _)| v), Some(b"mine".to_vec()));
        s.losses.set(super::OVERWRITE_TRIES);
        assert!(!s.overwrite("k", b"again"));
        assert_eq!(s.get("k").map(|(v, _)| v), Some(b"other worker".to_vec()));
    }
}
