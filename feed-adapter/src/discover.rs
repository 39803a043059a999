//! `kvsteer-discover`: the server side of the filter's `discovery` section. It answers
//! `GET /kvsteer/members` with the fleet's member list (docs/design/discovery.md), read from one of
//! two sources:
//!
//! - a **file** holding the document, read again on every request (so an operator or a config
//!   map edits the fleet by rewriting it; a half-written file is refused, not served);
//! - a Kubernetes **headless Service** resolved by DNS: every ready pod's IP is an A/AAAA record
//!   of the Service's name, so reading the fleet needs no API access and no RBAC.
//!
//! Either way the document is checked before it is served and a source that fails answers 503:
//! the filter keeps its last good membership through both, so a bad moment of the source never
//! empties a fleet.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

/// The path the filter polls by default (`discovery.path`).
pub const MEMBERS_PATH: &str = "/kvsteer/members";

/// One member, in the document's shape (the filter reads the same fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed: Option<String>,
    #[serde(default = "one")]
    pub ranks: u32,
    #[serde(default = "both")]
    pub role: String,
}

fn one() -> u32 {
    1
}
fn both() -> String {
    "both".into()
}

/// The member list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    pub members: Vec<Member>,
}

impl Document {
    /// Refuses what the filter would refuse, so a source's mistake shows here (503 and a log line)
    /// rather than only as a counter in every proxy.
    pub fn check(&self) -> Result<(), String> {
        if self.members.is_empty() {
            return Err("no member".into());
        }
        for (i, m) in self.members.iter().enumerate() {
            let name_ok = !m.name.is_empty()
                && m.name.len() <= 64
                && m.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !name_ok {
                return Err(format!("members[{i}].name {:?}", m.name));
            }
            if m.endpoint.parse::<SocketAddr>().is_err() {
                return Err(format!(
                    "members[{i}].endpoint {:?} is not IP:port",
                    m.endpoint
                ));
            }
            if let Some(f) = &m.feed
                && f.parse::<SocketAddr>().is_err()
            {
                return Err(format!("members[{i}].feed {f:?} is not IP:port"));
            }
            if self.members[..i].iter().any(|o| o.name == m.name) {
                return Err(format!("members[{i}].name {:?} listed twice", m.name));
            }
        }
        Ok(())
    }
}

/// Where the member list comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A file holding the document, read on every request.
    File(PathBuf),
    /// A headless Service's name, resolved on every request: one member per address.
    Dns(DnsSource),
}

/// A headless Service and what each of its pods serves.
#[derive(Clone, Debug)]
pub struct DnsSource {
    /// The Service's name (`vllm.inference.svc.cluster.local`).
    pub name: String,
    pub serving_port: u16,
    /// The feed adapter's port on each pod (the serving port when the engine answers its own feed).
    pub feed_port: Option<u16>,
    pub ranks: u32,
}

impl DnsSource {
    /// The document for the addresses the name resolved to: each pod a member named after its
    /// address (`pod-10-0-0-5`), sorted so the list does not move with the resolver's order.
    pub fn document(&self, addrs: impl IntoIterator<Item = IpAddr>) -> Document {
        let mut ips: Vec<IpAddr> = addrs.into_iter().collect();
        ips.sort();
        ips.dedup();
        let members = ips
            .into_iter()
            .map(|ip| {
                let name = format!(
                    "pod-{}",
                    ip.to_string()
                        .chars()
                        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
                        .collect::<String>()
                );
                Member {
                    name,
                    endpoint: SocketAddr::new(ip, self.serving_port).to_string(),
                    feed: self.feed_port.map(|p| SocketAddr::new(ip, p).to_string()),
                    ranks: self.ranks,
                    role: both(),
                }
            })
            .collect();
        Document { members }
    }
}

struct Shared {
    source: Source,
    resolver: Option<hickory_resolver::TokioResolver>,
}

/// Reads the member list from the source, checked.
async fn read(shared: &Shared) -> Result<Document, String> {
    let doc = match &shared.source {
        Source::File(path) => {
            let bytes = tokio::fs::read(path)
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?;
            serde_json::from_slice::<Document>(&bytes)
                .map_err(|e| format!("{}: {e}", path.display()))?
        }
        Source::Dns(dns) => {
            let resolver = shared
                .resolver
                .as_ref()
                .ok_or_else(|| "no resolver".to_string())?;
            let found = resolver
                .lookup_ip(dns.name.as_str())
                .await
                .map_err(|e| format!("{}: {e}", dns.name))?;
            dns.document(found.iter())
        }
    };
    doc.check()?;
    Ok(doc)
}

async fn members(State(shared): State<Arc<Shared>>) -> Response {
    match read(&shared).await {
        Ok(doc) => {
            let body = serde_json::to_vec(&doc).unwrap_or_default();
            ([(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "member list unavailable; answering 503");
            (StatusCode::SERVICE_UNAVAILABLE, e).into_response()
        }
    }
}

/// The HTTP service for a source. A DNS source gets a resolver from the system's configuration
/// with its cache bounded to a second, so pods that come and go are seen at the next poll.
pub fn app(source: Source) -> Result<Router, String> {
    let resolver = match &source {
        Source::Dns(_) => {
            let mut b = hickory_resolver::TokioResolver::builder_tokio()
                .map_err(|e| format!("DNS configuration: {e}"))?;
            b.options_mut().positive_max_ttl = Some(std::time::Duration::from_secs(1));
            b.options_mut().negative_max_ttl = Some(std::time::Duration::from_secs(1));
            Some(b.build().map_err(|e| format!("DNS resolver: {e}"))?)
        }
        Source::File(_) => None,
    };
    let shared = Arc::new(Shared { source, resolver });
    Ok(Router::new()
        .route(MEMBERS_PATH, get(members))
        .route("/health", get(|| async { "ok" }))
        .with_state(shared))
}
