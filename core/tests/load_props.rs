//! Property test: any interleaving of request-life events keeps the load table consistent, and
//! releasing everything returns every replica to zero.

use kvsteer_core::load::{Accounting, LoadTable, LoadTotals};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Ev {
    /// id, replica, prompt tokens, uncached tokens, output hint, (prefix family, full blocks)
    Admit(u64, usize, u64, u64, Option<u64>, (u64, usize)),
    First(u64),
    Progress(u64, u64),
    Release(u64),
}

/// Full-block hashes of a prompt: requests of one family share their leading blocks, as requests of
/// one session or one system prompt do.
fn blocks(family: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| family << 32 | i).collect()
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        (
            0u64..12,
            0usize..4,
            0u64..5000,
            0u64..5000,
            prop::option::of(0u64..3000),
            (0u64..3, 0usize..400),
        )
            .prop_map(|(id, r, p, u, h, b)| Ev::Admit(id, r, p, u, h, b)),
        (0u64..12).prop_map(Ev::First),
        (0u64..12, 0u64..4000).prop_map(|(id, g)| Ev::Progress(id, g)),
        (0u64..12).prop_map(Ev::Release),
    ]
}

proptest! {
    #[test]
    fn releasing_everything_returns_to_zero(
        evs in prop::collection::vec(ev(), 0..200),
        flags in any::<(bool, bool, bool, bool)>(),
    ) {
        let accounting = Accounting {
            prompt_blocks_at_admission: flags.0,
            assume_kv_reuse: flags.1,
            use_output_hint: flags.2,
            prefill_in_time: flags.3.then_some(25_000),
        };
        // Replica 3 is out of range for a 3-replica table: refused, never a panic.
        let mut t = LoadTable::new(3, 16, accounting);
        // What each tracked request booked, to check the shared prefix the table reports.
        let mut live: std::collections::HashMap<u64, (usize, u64, usize)> = Default::default();
        for e in &evs {
            match *e {
                Ev::Admit(id, r, p, u, h, (fam, n)) => {
                    if t.admit(id, r, p, u, h, blocks(fam, n)) {
                        let booked = n.min(p.div_ceil(16) as usize);
                        live.insert(id, (r, fam, booked));
                    }
                }
                Ev::First(id) => t.first_token(id),
                Ev::Progress(id, g) => t.decode_progress(id, g),
                Ev::Release(id) => { t.release(id); live.remove(&id); }
            }
            let active: u32 = t.totals().iter().map(|x| x.active_requests).sum();
            prop_assert_eq!(active as usize, t.active());
            if accounting.assume_kv_reuse && accounting.prompt_blocks_at_admission {
                for r in 0..3 {
                    for fam in 0..3u64 {
                        let want = live
                            .values()
                            .filter(|&&(lr, lf, _)| lr == r && lf == fam)
                            .map(|&(_, _, n)| n)
                            .max()
                            .unwrap_or(0);
                        prop_assert_eq!(t.active_prefix(r, &blocks(fam, 400)), want);
                    }
                }
            }
        }
        for id in 0..12 {
            t.release(id);
        }
        prop_assert!(t.totals().iter().all(|x| *x == LoadTotals::default()), "{:?}", t.totals());
        for r in 0..3 {
            prop_assert_eq!(t.active_prefix(r, &blocks(0, 400)), 0);
        }
    }
}
