//! The binary as an operator runs it: on every configuration the repository ships (each must pass,
//! or the guides would tell operators to deploy something the filter refuses) and on the bad pushes
//! the filter refuses, with the exit code and the filter's own message.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvsteer-check");

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(args: &[&str], stdin: Option<&str>) -> Run {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// A repository file's path as an argument, whatever directory the test runs in.
fn file(path: &str) -> String {
    repo().join(path).to_str().unwrap().into()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap()
}

fn replica(i: usize, name: &str) -> String {
    format!(
        r#"{{"name": "{name}", "endpoint": "10.0.{}.{}:8000", "feed_cluster": "f{i}"}}"#,
        i / 200,
        i % 200
    )
}

fn config(replicas: &[String]) -> String {
    format!(r#"{{"replicas": [{}]}}"#, replicas.join(", "))
}

/// One replica and one more top-level field (`"name": value`).
fn config_with(field: &str) -> String {
    format!(r#"{{{field}, "replicas": [{}]}}"#, replica(0, "a"))
}

#[test]
fn every_committed_configuration_is_accepted() {
    let mut checked = Vec::new();
    for dir in ["envoy", "istio", "nginx"] {
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let ext = path.extension().and_then(|e| e.to_str());
            if !matches!(ext, Some("yaml" | "json" | "conf")) {
                continue;
            }
            let shown = format!("{dir}/{}", path.file_name().unwrap().to_str().unwrap());
            let r = run(&[path.to_str().unwrap()], None);
            match r.code {
                0 => {
                    // The discovery variant has no static replica and 16 slots for members; a
                    // two-pool example says so, then names each pool.
                    if shown.contains("pools") {
                        let lines: Vec<&str> = r.stdout.lines().collect();
                        assert_eq!(lines.len(), 3, "{shown}: {}", r.stdout);
                        assert!(
                            lines[0].contains(": ok: 2 pools, "),
                            "{shown}: {}",
                            lines[0]
                        );
                        for (line, pool) in lines[1..].iter().zip(["chat", "big"]) {
                            assert!(line.contains(&format!(": pool {pool}: models ")), "{line}");
                            assert!(line.ends_with("policy kv_time"), "{line}");
                        }
                        checked.push(shown);
                        continue;
                    }
                    let want = if shown == "envoy/envoy-discovery.yaml" {
                        ": ok: 0 replicas and 16 discovery slots, policy kv_time"
                    } else {
                        ": ok: 4 replicas, policy kv_time"
                    };
                    for line in r.stdout.lines() {
                        assert!(line.contains(want), "{shown}: {line}");
                    }
                    checked.push(shown);
                }
                // Files without the filter (the round-robin peers, the Istio clusters and routes).
                2 => assert!(
                    r.stderr.contains("no Envoy wasm filter"),
                    "{shown}: {}",
                    r.stderr
                ),
                _ => panic!("{shown}: exit {}\n{}{}", r.code, r.stdout, r.stderr),
            }
        }
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            "envoy/envoy-cluster-header.yaml",
            "envoy/envoy-discovery.yaml",
            "envoy/envoy-pd.yaml",
            "envoy/envoy-pools.yaml",
            "envoy/envoy.yaml",
            "istio/kvsteer-filter.yaml",
            "istio/kvsteer-pools.yaml",
            "istio/wasmplugin.yaml",
            "nginx/nginx-pools.conf",
            "nginx/nginx.conf",
        ]
    );
}

/// A bootstrap whose plugin configuration names a feed cluster the bootstrap lacks (a renamed
/// cluster, a replica added to the configuration only) is refused, naming the entry: the filter
/// accepts it and every poll of that feed fails. A configuration read without its bootstrap cannot
/// be judged on that, and is not.
#[test]
fn a_cluster_the_bootstrap_lacks_is_refused() {
    let good = read("envoy/envoy.yaml");
    let bad = good.replacen(
        r#""feed_cluster": "kvsteer_feed_r2""#,
        r#""feed_cluster": "kvsteer_feed_r9""#,
        1,
    );
    assert_ne!(bad, good);
    let r = run(&["-"], Some(&bad));
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains(
            "refused: replicas[2].feed_cluster names cluster \"kvsteer_feed_r9\", which the \
             bootstrap does not define"
        ),
        "{}",
        r.stdout
    );
    // The same plugin configuration on its own: no bootstrap, no clusters to compare with.
    let alone = config(&[
        r#"{"name": "a", "endpoint": "10.0.0.1:8000", "feed_cluster": "nowhere"}"#.to_string(),
    ]);
    assert_eq!(run(&["-"], Some(&alone)).code, 0);
}

#[test]
fn where_each_configuration_was_found_is_named() {
    let r = run(&[&file("envoy/envoy.yaml")], None);
    assert_eq!(r.code, 0);
    assert_eq!(
        r.stdout,
        "wasm filter \"kvsteer\": ok: 4 replicas, policy kv_time\n"
    );
    let r = run(&[&file("istio/wasmplugin.yaml")], None);
    assert_eq!(
        r.stdout,
        "WasmPlugin \"kvsteer\" pluginConfig: ok: 4 replicas, policy kv_time\n"
    );
    let r = run(&[&file("nginx/nginx.conf")], None);
    assert!(
        r.stdout.starts_with("proxy_wasm kvsteer (line "),
        "{}",
        r.stdout
    );
}

#[test]
fn more_replicas_than_the_filter_holds_are_refused() {
    let replicas: Vec<String> = (0..257).map(|i| replica(i, &format!("r{i}"))).collect();
    let r = run(&[], Some(&config(&replicas)));
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stdout,
        "refused: replicas: at most 256 routing units (replicas x dp_ranks), got 257\n"
    );
    let r = run(&[], Some(&config(&replicas[..256])));
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert_eq!(r.stdout, "ok: 256 replicas, policy kv_time\n");
}

#[test]
fn a_duplicated_replica_name_is_refused() {
    let r = run(&["-"], Some(&config(&[replica(0, "a"), replica(1, "a")])));
    assert_eq!(r.code, 1);
    assert_eq!(r.stdout, "refused: replicas[1].name: duplicate \"a\"\n");
}

/// The configuration on standard input is refused with a message starting `refused: {start}`.
fn assert_refused(input: &str, start: &str) {
    let r = run(&[], Some(input));
    assert_eq!(r.code, 1, "{}", r.stdout);
    let want = format!("refused: {start}");
    assert!(r.stdout.starts_with(&want), "{}", r.stdout);
}

#[test]
fn garbage_and_unknown_fields_get_the_parsers_message() {
    assert_refused("{\"replicas\": [", "plugin configuration: EOF");
    assert_refused(
        &config_with(r#""tick_msx": 5"#),
        "plugin configuration: unknown field `tick_msx`",
    );
}

#[cfg(feature = "tokenizer")]
#[test]
fn settings_the_router_refuses_after_the_parser_are_refused_too() {
    // The parser takes any chat template name; the router state looks it up (as on_configure does).
    assert_refused(
        &config_with(r#""tokenizer": {"chat_template": "nope"}"#),
        "tokenizer.chat_template: unknown chat template \"nope\"",
    );
}

/// A tokenizer bundle fetched at run time (`tokenizer.huggingface.fetch`): the section is checked
/// without the bundle, as `on_configure` checks it.
#[cfg(feature = "tokenizer")]
#[test]
fn a_fetched_tokenizer_bundle_section_is_checked() {
    let sha = "ab".repeat(32);
    let fetch = |f: &str| {
        config_with(&format!(
            r#""tokenizer": {{"huggingface": {{"fetch": {{{f}}}}}}}"#
        ))
    };
    let ok = fetch(&format!(
        r#""cluster": "kvsteer_tokenizer", "sha256": "{sha}""#
    ));
    let r = run(&[], Some(&ok));
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert_refused(
        &fetch(r#""cluster": "kvsteer_tokenizer", "sha256": "abc""#),
        "tokenizer.huggingface.fetch.sha256: must be 64 hex digits",
    );
    assert_refused(
        &fetch(&format!(
            r#""cluster": "t", "sha256": "{sha}", "max_bytes": 0"#
        )),
        "tokenizer.huggingface.fetch.max_bytes",
    );
    assert_refused(
        &fetch(&format!(r#""cluster": "t", "sha256": "{sha}", "bogus": 1"#)),
        "plugin configuration: unknown field `bogus`, expected one of `cluster`",
    );
    let both = config_with(&format!(
        r#""tokenizer": {{"huggingface": {{"tokenizer_json": "{{}}",
            "fetch": {{"cluster": "t", "sha256": "{sha}"}}}}}}"#
    ));
    assert_refused(
        &both,
        "tokenizer.huggingface.fetch: give the files inline or fetch them",
    );
}

#[test]
fn a_bad_configuration_inside_a_manifest_is_found_and_refused() {
    let envoy = read("envoy/envoy.yaml").replace("\"name\": \"r1\"", "\"name\": \"r0\"");
    let r = run(&[], Some(&envoy));
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stdout,
        "wasm filter \"kvsteer\": refused: replicas[1].name: duplicate \"r0\"\n"
    );
    let plugin = read("istio/wasmplugin.yaml").replace("name: vllm-1,", "name: vllm-0,");
    let r = run(&["--from", "manifest"], Some(&plugin));
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stdout,
        "WasmPlugin \"kvsteer\" pluginConfig: refused: replicas[1].name: duplicate \"vllm-0\"\n"
    );
}

#[test]
fn warnings_are_printed_after_ok() {
    // The warning is `kv_load`'s (its reported-load modes were measured with peers).
    let cfg = config_with(
        r#""peers": {"token": "0123456789abcdef0123456789abcdef"}, "routing": {"policy": "kv_load"}"#,
    );
    let r = run(&[], Some(&cfg));
    assert_eq!(r.code, 0, "{}", r.stdout);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "ok: 1 replicas, policy kv_load");
    assert!(
        lines[1].starts_with("warning: peers is meant for routing.load.reported_load"),
        "{}",
        lines[1]
    );
    let r = run(&["--json"], Some(&cfg));
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["configs"][0]["replicas"], 1);
    assert_eq!(v["configs"][0]["policy"], "kv_load");
    assert_eq!(v["configs"][0]["warnings"].as_array().unwrap().len(), 1);
}

#[test]
fn json_output_for_a_refusal_and_for_unreadable_input() {
    let r = run(&["--json", &file("envoy/envoy.yaml")], None);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["configs"][0]["place"], "wasm filter \"kvsteer\"");
    let r = run(&["--json"], Some("{"));
    assert_eq!(r.code, 1);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert!(
        v["configs"][0]["error"]
            .as_str()
            .unwrap()
            .starts_with("plugin configuration:")
    );
    let r = run(&["--json", "no/such/file.json"], None);
    assert_eq!(r.code, 2);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert!(v["unreadable"].as_str().unwrap().contains("No such file"));
}

#[test]
fn unreadable_input_exits_2() {
    let r = run(&["no/such/file.json"], None);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("no/such/file.json"), "{}", r.stderr);
    assert!(r.stdout.is_empty());
    // A bootstrap without the filter: nothing to judge, not a refused plugin configuration.
    let r = run(&[&file("envoy/envoy-round-robin.yaml")], None);
    assert_eq!(r.code, 2);
    let r = run(&["--from", "manifest"], Some("a: [unclosed"));
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("not YAML or JSON"), "{}", r.stderr);
}
