//! The discovery source as the harness answers it: the member list a test sets (or any answer:
//! garbage, an error), and the feed polls of discovered members, which reach their replica through
//! one cluster by the feed address in the destination header (Envoy's `override_host`).

use super::Harness;
use crate::host::{CallOutcome, Callout};

/// The cluster the filter's `discovery.cluster` names in the harness.
pub const DISCOVERY_CLUSTER: &str = "kvsteer_discovery";
/// The cluster of discovered members' feeds (`discovery.feed_cluster`).
pub const MEMBER_FEEDS_CLUSTER: &str = "kvsteer_member_feeds";
/// The header whose value the feed cluster's `override_host` reads (the filter's default
/// `destination_header`).
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

impl Harness {
    /// How the discovery source answers from now on (`None`: 503, as `kvsteer-discover` with a
    /// failing source).
    pub fn set_discovery_answer(&mut self, answer: Option<CallOutcome>) {
        self.discovery_answer = answer;
    }

    /// The source answers this member list (the replicas' names and endpoints; their feed is on
    /// their endpoint).
    pub fn set_members(&mut self, replicas: &[usize]) {
        let body = self.member_list(replicas);
        self.set_discovery_answer(Some(CallOutcome::ok(200, "application/json", body)));
    }

    /// The member list of `replicas`, as `kvsteer-discover` would write it.
    pub fn member_list(&self, replicas: &[usize]) -> Vec<u8> {
        let members: Vec<serde_json::Value> = replicas
            .iter()
            .map(|&r| {
                let rep = &self.replicas[r];
                serde_json::json!({"name": rep.name, "endpoint": rep.endpoint})
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({ "members": members })).unwrap_or_default()
    }

    /// Discovery polls answered so far.
    pub fn discovery_polls(&self) -> u64 {
        self.discovery_polls
    }

    /// The answer to a discovery poll now, counted.
    pub(super) fn discovery_outcome(&mut self) -> CallOutcome {
        self.discovery_polls += 1;
        self.discovery_answer
            .clone()
            .unwrap_or_else(|| CallOutcome::ok(503, "text/plain", b"no member list".to_vec()))
    }

    /// The replica a discovered member's feed poll reaches: the one whose endpoint the destination
    /// header names (override_host), none when it names no replica.
    pub(super) fn member_feed_replica(&self, call: &Callout) -> Option<usize> {
        self.replica_of_endpoint(call.header(DESTINATION_HEADER)?)
    }
}
