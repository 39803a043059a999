//! Property test: any interleaving of request-life events keeps the load table consistent, and
//! releasing everything returns every replica to zero.

use kvsteer_core::load::{LoadTable, LoadTotals};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Ev {
    Admit(u64, usize, u64, u64, Option<u64>),
    First(u64),
    Progress(u64, u64),
    Release(u64),
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        (
            0u64..12,
            0usize..4,
            0u64..5000,
            0u64..5000,
            prop::option::of(0u64..3000)
        )
            .prop_map(|(id, r, p, u, h)| Ev::Admit(id, r, p, u, h)),
        (0u64..12).prop_map(Ev::First),
        (0u64..12, 0u64..4000).prop_map(|(id, g)| Ev::Progress(id, g)),
        (0u64..12).prop_map(Ev::Release),
    ]
}

proptest! {
    #[test]
    fn releasing_everything_returns_to_zero(evs in prop::collection::vec(ev(), 0..200), hint in any::<bool>()) {
        // Replica 3 is out of range for a 3-replica table: refused, never a panic.
        let mut t = LoadTable::new(3, 16, hint);
        for e in &evs {
            match *e {
                Ev::Admit(id, r, p, u, h) => { t.admit(id, r, p, u, h); }
                Ev::First(id) => t.first_token(id),
                Ev::Progress(id, g) => t.decode_progress(id, g),
                Ev::Release(id) => { t.release(id); }
            }
            let active: u32 = t.totals().iter().map(|x| x.active_requests).sum();
            prop_assert_eq!(active as usize, t.active());
        }
        for id in 0..12 {
            t.release(id);
        }
        prop_assert!(t.totals().iter().all(|x| *x == LoadTotals::default()), "{:?}", t.totals());
    }
}
