//! LoRA adapters through the compiled filter: the replicas' feeds report the adapters their requests
//! use, and with `routing.adapters` configured a request for an adapter goes to the replica that
//! has it loaded when the replicas are otherwise equal; without the configuration, or from replicas
//! whose feed says nothing about adapters, routing is adapter-blind.

mod common;
use common::*;
use kvsteer_host_test::{Harness, HarnessConfig, RequestSpec};
use kvsteer_sim::lora::LoraConfig;
use serde_json::json;

const HOLDER: usize = 2;

/// Four replicas with two adapter slots each, each running one long request of the same size: the
/// holder's for adapter `sql`, the others' for adapters of their own. The feeds have caught up.
fn fleet(policy: &str, adapters_configured: bool, lora_on: bool) -> Harness {
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = 1;
    cfg.engine.lora = LoraConfig {
        slots: if lora_on { 2 } else { 0 },
        load_us: 300_000,
    };
    cfg.routing = json!({"policy": policy, "block_size": 16});
    if adapters_configured {
        cfg.routing["adapters"] = json!({"base_models": [kvsteer_host_test::openai::MODEL]});
    }
    let mut h = harness_with(cfg);
    for r in 0..4 {
        let adapter = if r == HOLDER {
            "sql".to_string()
        } else {
            format!("other-{r}")
        };
        h.submit_direct_for(r, tokens(900 + r as u64, 256), 20_000, Some(&adapter))
            .unwrap();
    }
    h.run_for(1_000_000).unwrap();
    h
}

/// Where five fresh requests for `sql`, sent one after another, went.
fn destinations(h: &mut Harness) -> Vec<usize> {
    (0..5u64)
        .map(|i| {
            let spec = RequestSpec::new(tokens(50 + i, 256), 8).model("sql");
            let id = h.send(&spec).unwrap();
            h.run_for(2_000_000).unwrap();
            let r = h.record(id).unwrap();
            assert!(!r.failed, "{r:?}");
            r.replica.unwrap()
        })
        .collect()
}

#[test]
fn a_request_for_a_loaded_adapter_goes_to_the_replica_holding_it() {
    for policy in ["kv_time", "adapter_affinity"] {
        let mut h = fleet(policy, true, true);
        assert_eq!(destinations(&mut h), vec![HOLDER; 5], "{policy}");
        assert_clean(&h);
        // The holder loaded nothing for them; each other replica loaded only its own adapter.
        assert_eq!(h.replicas[HOLDER].engine.adapter_loads(), 1, "{policy}");
    }
}

#[test]
fn without_the_configuration_or_the_report_routing_is_adapter_blind() {
    for (configured, lora_on) in [(false, true), (true, false)] {
        let mut h = fleet("kv_time", configured, lora_on);
        let d = destinations(&mut h);
        assert!(
            d.iter().any(|&r| r != HOLDER),
            "configured {configured}, reported {lora_on}: {d:?}"
        );
        assert_clean(&h);
    }
}

/// A replica answering with a hostile adapter section: one over the bounds is refused like any
/// malformed answer (counted, the replica's feed not trusted), one at the bounds is accepted; the
/// filter neither traps nor stops routing.
#[test]
fn a_hostile_adapter_section_is_refused_or_bounded() {
    use kvsteer_core::feed::{AdapterReport, FeedBatch, MAX_ADAPTER_NAMES};
    use kvsteer_host_test::FeedFault;
    let metric = |h: &Harness, name: &str| h.proxy().metric(name).map_or(0, |m| m.value);
    let at_bound = AdapterReport {
        slots: u32::MAX,
        running: (0..MAX_ADAPTER_NAMES)
            .map(|i| format!("{i:0>255}"))
            .collect(),
        waiting: (0..MAX_ADAPTER_NAMES)
            .map(|i| format!("w{i:0>254}"))
            .collect(),
    };
    let mut good = FeedBatch::snapshot(77, vec![1, 2, 3]).encode();
    at_bound.append_to(&mut good);
    let mut over = good.clone();
    let section = FeedBatch::snapshot(77, vec![1, 2, 3]).encode().len();
    over[section + 4..section + 6].copy_from_slice(&(MAX_ADAPTER_NAMES as u16 + 1).to_le_bytes());
    for (bytes, refused) in [(good, false), (over, true)] {
        let mut h = fleet("kv_time", true, true);
        let before = metric(&h, "kvsteer_feed_errors_r1");
        h.set_feed_fault(1, FeedFault::Garbage(bytes));
        h.run_for(2_000_000).unwrap();
        let errors = metric(&h, "kvsteer_feed_errors_r1") - before;
        assert_eq!(errors > 0, refused, "errors {errors}");
        destinations(&mut h);
        assert_clean(&h);
    }
}

/// The filter hashes an adapter's prompt in the adapter's namespace, as the engines hash its blocks:
/// a request for `sql` finds the prefix an earlier `sql` request left, and one for the base model
/// with the same prompt finds nothing of it.
#[test]
fn an_adapters_cached_prefix_is_found_in_its_namespace() {
    let mut h = fleet("kv_time", true, true);
    let prefix = tokens(4242, 1024);
    let send = |h: &mut Harness, model: Option<&str>, seed: u64| {
        let mut spec = RequestSpec::new(extend(&prefix, seed, 64), 8);
        spec.model = model.map(String::from);
        let id = h.send(&spec).unwrap();
        h.run_for(2_000_000).unwrap();
        h.record(id).unwrap().clone()
    };
    // What the filter expected cached on the replica it chose (`kvsteer_matched_tokens`).
    let matched = |h: &Harness| {
        h.proxy()
            .metric("kvsteer_matched_tokens")
            .map_or(0, |m| m.value)
    };
    let first = send(&mut h, Some("sql"), 1);
    let before = matched(&h);
    let again = send(&mut h, Some("sql"), 2);
    assert_eq!(again.replica, first.replica, "{again:?}");
    assert!(again.cached_tokens >= 1024, "{again:?}");
    assert!(
        matched(&h) - before >= 1024,
        "the filter found the adapter's prefix"
    );
    let before = matched(&h);
    let base = send(&mut h, None, 3);
    assert!(
        base.cached_tokens < 16,
        "the base model shares no block: {base:?}"
    );
    assert!(matched(&h) - before < 16, "nor does the filter expect one");
    assert_clean(&h);
}
