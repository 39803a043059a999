//! `kvsteer-discover`'s service: the file source read again on each request, a bad file answered
//! 503, and the member list a headless Service's addresses make.

use kvsteer_feed::discover::{DnsSource, Document, Source, app};
use std::net::IpAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_file_is_read_again_on_every_request_and_a_bad_one_is_not_served() {
    let dir = std::env::temp_dir().join(format!("kvsteer-discover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("members.json");
    std::fs::write(
        &file,
        r#"{"members":[{"name":"a","endpoint":"10.0.0.1:8000","feed":"10.0.0.1:9000"}]}"#,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(Source::File(file.clone())).unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (status, body) = get(addr, "/kvsteer/members").await;
    assert_eq!(status, 200, "{body}");
    let doc: Document = serde_json::from_str(&body).unwrap();
    assert_eq!(doc.members.len(), 1);
    assert_eq!(doc.members[0].feed.as_deref(), Some("10.0.0.1:9000"));
    assert_eq!(
        (doc.members[0].ranks, doc.members[0].role.as_str()),
        (1, "both")
    );
    // Rewritten: the next request sees it.
    std::fs::write(
        &file,
        r#"{"members":[{"name":"a","endpoint":"10.0.0.1:8000"},{"name":"b","endpoint":"10.0.0.2:8000"}]}"#,
    )
    .unwrap();
    let (_, body) = get(addr, "/kvsteer/members").await;
    let doc: Document = serde_json::from_str(&body).unwrap();
    assert_eq!(doc.members.len(), 2);
    // Half written, empty, a bad address, a name twice, gone: 503, never a list.
    for bad in [
        r#"{"members":[{"name":"a","#,
        r#"{"members":[]}"#,
        r#"{"members":[{"name":"a","endpoint":"pod-a:8000"}]}"#,
        r#"{"members":[{"name":"a","endpoint":"10.0.0.1:1"},{"name":"a","endpoint":"10.0.0.2:1"}]}"#,
    ] {
        std::fs::write(&file, bad).unwrap();
        let (status, body) = get(addr, "/kvsteer/members").await;
        assert_eq!(status, 503, "{bad}: {body}");
    }
    std::fs::remove_file(&file).unwrap();
    assert_eq!(get(addr, "/kvsteer/members").await.0, 503);
    assert_eq!(get(addr, "/health").await.0, 200);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_headless_services_addresses_become_members_in_a_stable_order() {
    let dns = DnsSource {
        name: "vllm.default.svc.cluster.local".into(),
        serving_port: 8000,
        feed_port: Some(9000),
        ranks: 2,
    };
    let ips: Vec<IpAddr> = ["10.0.0.9", "10.0.0.5", "fd00::1", "10.0.0.5"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let doc = dns.document(ips);
    assert!(doc.check().is_ok());
    let names: Vec<&str> = doc.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["pod-10-0-0-5", "pod-10-0-0-9", "pod-fd00--1"]);
    assert_eq!(doc.members[2].endpoint, "[fd00::1]:8000");
    assert_eq!(doc.members[0].feed.as_deref(), Some("10.0.0.5:9000"));
    assert_eq!(doc.members[0].ranks, 2);
    let no_feed = DnsSource {
        feed_port: None,
        ..dns
    };
    assert_eq!(
        no_feed.document(["10.0.0.1".parse().unwrap()]).members[0].feed,
        None
    );
}

/// The DNS source end to end, on the one name every machine resolves (from its hosts file): each
/// address is a member on the serving and feed ports given.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_name_is_resolved_on_each_request() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(Source::Dns(DnsSource {
        name: "localhost".into(),
        serving_port: 8000,
        feed_port: Some(9000),
        ranks: 1,
    }))
    .unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (status, body) = get(addr, "/kvsteer/members").await;
    assert_eq!(status, 200, "{body}");
    let doc: Document = serde_json::from_str(&body).unwrap();
    assert!(
        doc.members
            .iter()
            .any(|m| m.endpoint == "127.0.0.1:8000" || m.endpoint == "[::1]:8000"),
        "{doc:?}"
    );
    assert!(
        doc.members
            .iter()
            .all(|m| m.feed.as_deref().is_some_and(|f| f.ends_with(":9000")))
    );
}
