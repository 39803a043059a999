//! The configuration's parsing and validation, natively: every default, every refusal naming its
//! field.

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

/// A `peers` section wants the other proxies' load too (`reported_load` merge or others) under
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
    let kv =
        |load: &str| format!(r#"{{"policy":"kv_load","kv_load":{{"reported_load":"{load}"}}}}"#);
    let w = warnings(&kv("max"), true);
    assert_eq!(w.len(), 1);
    assert!(
        w[0].starts_with("peers is meant for routing.kv_load.reported_load"),
        "{w:?}"
    );
    assert!(warnings(&kv("merge"), true).is_empty());
    assert!(warnings(&kv("others"), true).is_empty());
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

fn with_discovery(replicas: &str, discovery: &str, extra: &str) -> String {
    format!(r#"{{"replicas":[{replicas}],"discovery":{discovery}{extra}}}"#)
}

#[test]
fn the_discovery_section_adds_empty_slots_after_the_static_replicas() {
    let c = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
    assert_eq!(c.discovery, None);
    assert_eq!(c.static_units(), 2);
    let json = with_discovery(
        r#"{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","dp_ranks":2}"#,
        r#"{"cluster":"members","feed_cluster":"member_feeds"}"#,
        "",
    );
    let c = FilterConfig::from_json(json.as_bytes()).unwrap();
    let d = c.discovery.as_ref().unwrap();
    assert_eq!(
        (
            d.path.as_str(),
            d.period_ms,
            d.timeout_ms,
            d.hold_ms,
            d.max_members
        ),
        ("/kvsteer/members", 1_000, 1_000, 10_000, 64)
    );
    assert_eq!(d.max_response_bytes, 1 << 20);
    assert_eq!(c.static_units(), 2, "the two ranks");
    assert_eq!(c.replicas.len(), 66);
    assert_eq!(c.replicas[2].name, "_slot0");
    assert_eq!(c.feed_upstream(65), "member_feeds");
    assert_eq!(c.discovery_authority(), "members");
    // Discovery alone: no static replica needed.
    let json = with_discovery(
        "",
        r#"{"cluster":"members","feed_cluster":"mf","max_members":3,"authority":"disco.local"}"#,
        "",
    );
    let c = FilterConfig::from_json(json.as_bytes()).unwrap();
    assert_eq!((c.static_units(), c.replicas.len()), (0, 3));
    assert_eq!(c.discovery_authority(), "disco.local");
    // nginx: no feed cluster (a callout names the member's address).
    let json = with_discovery(
        "",
        r#"{"cluster":"127.0.0.1:7000"}"#,
        r#","output":"nginx_variable""#,
    );
    assert!(FilterConfig::from_json(json.as_bytes()).is_ok());
}

#[test]
fn the_discovery_section_is_checked() {
    let r0 = r#"{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}"#;
    let ok = r#""cluster":"m","feed_cluster":"mf""#;
    for (discovery, extra, needle) in [
        (
            r#"{"cluster":"m"}"#.to_string(),
            "",
            "discovery.feed_cluster: required with Envoy",
        ),
        (
            format!("{{{ok},\"max_members\":0}}"),
            "",
            "discovery.max_members: must be 1..=255",
        ),
        (
            format!("{{{ok},\"max_members\":256}}"),
            "",
            "discovery.max_members",
        ),
        (
            format!("{{{ok},\"period_ms\":50}}"),
            "",
            "discovery.period_ms",
        ),
        (
            format!("{{{ok},\"timeout_ms\":0}}"),
            "",
            "discovery.timeout_ms",
        ),
        (
            format!("{{{ok},\"hold_ms\":3600001}}"),
            "",
            "discovery.hold_ms",
        ),
        (
            format!("{{{ok},\"path\":\"members\"}}"),
            "",
            "discovery.path",
        ),
        (
            format!("{{{ok},\"max_response_bytes\":10}}"),
            "",
            "discovery.max_response_bytes",
        ),
        (format!("{{{ok},\"typo\":1}}"), "", "unknown field `typo`"),
        (
            r#"{"cluster":"","feed_cluster":"mf"}"#.into(),
            "",
            "discovery.cluster",
        ),
        (
            format!("{{{ok}}}"),
            r#","output":"cluster_header""#,
            "output: cluster_header mode",
        ),
    ] {
        let json = with_discovery(r0, &discovery, extra);
        let e = refused(&json);
        assert!(e.contains(needle), "{discovery} {extra}: {e}");
    }
    let json = with_discovery(
        r#"{"name":"_slot0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}"#,
        &format!("{{{ok}}}"),
        "",
    );
    assert!(refused(&json).contains("_slot"));
    assert!(refused(r#"{"replicas":[]}"#).contains("or a discovery section"));
    assert!(refused("{}").contains("or a discovery section"));
    let absent = r#"{"discovery":{"cluster":"m","feed_cluster":"mf","max_members":2}}"#;
    assert_eq!(
        FilterConfig::from_json(absent.as_bytes())
            .unwrap()
            .replicas
            .len(),
        2
    );
}
