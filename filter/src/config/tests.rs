//! The configuration's parsing and validation as a whole, natively: the defaults, the refusals
//! that name their field, the warnings; and the fixtures the sections' own tests share.

use super::*;

pub(super) const GOOD: &str = r#"{"replicas":[
    {"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"feed_r0"},
    {"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"feed_r1","feed_authority":"r1.local"}]}"#;

#[test]
fn defaults_fill_in() {
    let c = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
    assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
    assert_eq!(c.session_header, "x-session-id");
    assert_eq!(c.output, OutputMode::DestinationHeader);
    assert_eq!(c.feed_authority(0), "127.0.0.1:8000");
    assert_eq!(c.feed_authority(1), "r1.local");
    assert_eq!(c.feed_upstream(1), "feed_r1");
    assert_eq!(c.feed_max_bytes, 8 << 20);
    assert_eq!(c.feed_apply_blocks_per_tick, 8192);
    assert_eq!(c.feed_apply_us_per_tick, 500);
}

pub(super) fn refused(json: &str) -> String {
    FilterConfig::from_json(json.as_bytes())
        .unwrap_err()
        .to_string()
}

/// A routing setting under its old name is applied and its warning reaches the filter's list,
/// which the filter logs at configure time and `kvsteer-check` prints.
#[test]
fn a_routing_setting_under_its_old_name_is_warned_about() {
    let json = r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f"}],
        "routing":{"kv_load":{"host_tier_credit":0.5}}}"#;
    let c = FilterConfig::from_json(json.as_bytes()).unwrap();
    assert_eq!(c.routing.index.host_tier_credit, 0.5);
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("index.host_tier_credit"), "{w:?}");
}

/// A `peers` section wants the other proxies' load too (`load.reported_load` merge or others) under
/// `kv_load`: otherwise a warning, never a refusal; other policies have no reported load to merge.
#[test]
fn peers_without_merged_load_is_warned_about() {
    let token = r#""peers":{"proxies":[{"cluster":"b"}],"token":"0123456789abcdef"}"#;
    let warnings = |routing: &str, peers: bool| {
        let json = format!(
            r#"{{"replicas":[{{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f"}}],
                "routing":{routing}{}}}"#,
            if peers {
                format!(",{token}")
            } else {
                String::new()
            }
        );
        FilterConfig::from_json(json.as_bytes()).unwrap().warnings()
    };
    let kv = |load: &str| format!(r#"{{"policy":"kv_load","load":{{"reported_load":"{load}"}}}}"#);
    let w = warnings(&kv("max"), true);
    assert_eq!(w.len(), 1);
    assert!(
        w[0].starts_with("peers is meant for routing.load.reported_load"),
        "{w:?}"
    );
    assert!(warnings(&kv("merge"), true).is_empty());
    assert!(warnings(&kv("others"), true).is_empty());
    // The mode under its old name still counts: only its deprecation is noted.
    let old = warnings(
        r#"{"policy":"kv_load","kv_load":{"reported_load":"merge"}}"#,
        true,
    );
    assert_eq!(old.len(), 1, "{old:?}");
    assert!(
        old[0].starts_with("kv_load.reported_load is deprecated")
            && old[0].contains("load.reported_load instead"),
        "{old:?}"
    );
    assert!(
        warnings(&kv("max"), false).is_empty(),
        "no peers, nothing to warn about"
    );
    assert!(warnings(r#"{"policy":"least_load"}"#, true).is_empty());
}

#[test]
fn problems_are_named() {
    assert!(refused(r#"{"replicas":[]}"#).contains("replicas"));
    assert!(
        refused(r#"{"replicas":[{"name":"r0","endpoint":"nope","feed_cluster":"f"}]}"#)
            .contains("endpoint")
    );
    assert!(
        refused(r#"{"replicas":[{"name":"r 0","endpoint":"1.2.3.4:5","feed_cluster":"f"}]}"#)
            .contains("name")
    );
    assert!(
        refused(r#"{"replicas":[{"name":"r0","endpoint":"1.2.3.4:5"}]}"#).contains("feed_cluster")
    );
    let typo = GOOD.replacen("{\"replicas\"", "{\"polcy\":1,\"replicas\"", 1);
    assert!(refused(&typo).contains("polcy"));
    let bad_header = GOOD.replacen(
        "{\"replicas\"",
        "{\"destination_header\":\"X Bad\",\"replicas\"",
        1,
    );
    assert!(refused(&bad_header).contains("destination_header"));
    let nginx = GOOD.replacen(
        "{\"replicas\"",
        "{\"output\":\"nginx_variable\",\"replicas\"",
        1,
    );
    assert!(refused(&nginx).contains("feed_address"));
    assert!(refused("not json").contains("plugin configuration"));
    let dup = r#"{"replicas":[{"name":"a","endpoint":"1.2.3.4:5","feed_cluster":"f"},
                             {"name":"a","endpoint":"1.2.3.4:6","feed_cluster":"g"}]}"#;
    assert!(refused(dup).contains("duplicate"));
    for (field, bad) in [
        ("feed_max_bytes", "10"),
        ("feed_max_bytes", "2000000000"),
        ("feed_apply_blocks_per_tick", "0"),
        ("feed_max_events", "0"),
    ] {
        let json = GOOD.replacen(
            "{\"replicas\"",
            &format!("{{\"{field}\":{bad},\"replicas\""),
            1,
        );
        assert!(refused(&json).starts_with(field), "{field} = {bad}");
    }
}
