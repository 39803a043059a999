//! Writing a decision where the proxy reads it: the routing header (destination or cluster), the
//! nginx variable, the DP rank header, and the values they carry, formatted at configure time.

use super::WorkerState;
use crate::config::{FilterConfig, OutputMode};
use kvsteer_core::router::Decision;
use std::borrow::Cow;

/// Where a routing decision is written for the proxy to read it, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecisionOutput<'a> {
    /// A request header (the destination or the cluster header). With the cluster header the route
    /// was chosen before the header existed, so Envoy must be told to choose again
    /// (`clear_route_cache`).
    Header {
        name: &'a str,
        value: Cow<'a, str>,
        clear_route_cache: bool,
    },
    /// nginx: the variable `["ngx", name]`.
    NginxVariable { name: &'a str, value: Cow<'a, str> },
}

/// The values a decision is written as, formatted at configure time so that a request only picks
/// one: per replica its own value (endpoint, or cluster in cluster-header mode) and, in
/// destination-header mode with `retry_backup`, every `primary,backup` pair while the fleet is
/// small enough for the table ([`Destinations::MAX_PAIR_TABLE`] replicas: 4,096 pairs); larger
/// fleets format the pair per request. Beside them, per unit, the rank header's value.
#[derive(Clone, Debug, Default)]
pub struct Destinations {
    single: Vec<String>,
    /// `pairs[primary * replicas + backup]`; empty when not used or too large.
    pairs: Vec<String>,
    /// Per unit, the rank header's value (`None`: a unit without a rank).
    ranks: Vec<Option<String>>,
}

impl Destinations {
    pub const MAX_PAIR_TABLE: usize = 64;

    pub(super) fn new(cfg: &FilterConfig) -> Destinations {
        let single: Vec<String> = cfg
            .units
            .iter()
            .map(|r| match cfg.output {
                OutputMode::ClusterHeader => {
                    r.cluster.clone().unwrap_or_else(|| r.endpoint.clone())
                }
                _ => r.endpoint.clone(),
            })
            .collect();
        let n = cfg.units.len();
        let pairs = if cfg.output == OutputMode::DestinationHeader
            && cfg.retry_backup
            && n <= Self::MAX_PAIR_TABLE
        {
            (0..n * n)
                .map(|k| {
                    format!(
                        "{},{}",
                        cfg.units[k / n].endpoint,
                        cfg.units[k % n].endpoint
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        let ranks = cfg
            .units
            .iter()
            .map(|r| r.rank.map(|k| k.to_string()))
            .collect();
        Destinations {
            single,
            pairs,
            ranks,
        }
    }

    /// The rank header's value for a unit (`None`: a unit without a rank, or out of range).
    fn rank(&self, unit: usize) -> Option<&str> {
        self.ranks.get(unit)?.as_deref()
    }

    /// The value for `replica` with an optional backup (indices clamped to the fleet: the routing
    /// path must not panic).
    fn value<'a>(
        &'a self,
        cfg: &FilterConfig,
        replica: usize,
        backup: Option<usize>,
    ) -> Cow<'a, str> {
        let n = self.single.len();
        let last = n.saturating_sub(1);
        let r = replica.min(last);
        let single = || Cow::Borrowed(self.single.get(r).map_or("", String::as_str));
        match (cfg.output, backup) {
            (OutputMode::DestinationHeader, Some(b)) => {
                let b = b.min(last);
                match self.pairs.get(r * n + b) {
                    Some(v) => Cow::Borrowed(v.as_str()),
                    None => Cow::Owned(format!(
                        "{},{}",
                        self.single.get(r).map_or("", String::as_str),
                        self.single.get(b).map_or("", String::as_str)
                    )),
                }
            }
            _ => single(),
        }
    }
}

impl WorkerState {
    /// The header that carries the routing decision (destination or cluster header): clients must
    /// never send it.
    pub fn routing_header(&self) -> &str {
        match self.cfg.output {
            OutputMode::ClusterHeader => &self.cfg.cluster_header,
            _ => &self.cfg.destination_header,
        }
    }

    /// The header carrying the chosen DP rank: clients must never send it either (always removed,
    /// whether or not any replica has ranks).
    pub fn rank_header(&self) -> &str {
        &self.cfg.rank_header
    }

    /// The rank header's value for a decision: `Some` only when the chosen unit is a DP rank.
    pub fn rank_value(&self, d: &Decision) -> Option<&str> {
        self.rank_of_unit(d.replica)
    }

    /// The rank header's value for a unit (`None`: a unit without a rank).
    pub fn rank_of_unit(&self, replica: usize) -> Option<&str> {
        self.destinations.rank(replica)
    }

    /// The value to write for the chosen replica, per output mode. With the destination header and
    /// `retry_backup`, the router's second choice follows after a comma: Envoy's override_host policy
    /// tries the listed hosts in order on retries, so a request whose replica just died is retried on
    /// the next best one rather than wherever the fallback policy lands.
    pub fn destination(&self, d: &Decision) -> Cow<'_, str> {
        let backup = d.backup.filter(|_| self.cfg.retry_backup);
        self.destinations.value(&self.cfg, d.replica, backup)
    }

    /// Where and what to write for a decision, per output mode.
    pub fn decision_output(&self, d: &Decision) -> DecisionOutput<'_> {
        let value = self.destination(d);
        match self.cfg.output {
            OutputMode::DestinationHeader => DecisionOutput::Header {
                name: &self.cfg.destination_header,
                value,
                clear_route_cache: false,
            },
            OutputMode::ClusterHeader => DecisionOutput::Header {
                name: &self.cfg.cluster_header,
                value,
                clear_route_cache: true,
            },
            OutputMode::NginxVariable => DecisionOutput::NginxVariable {
                name: &self.cfg.nginx_variable,
                value,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    /// The destination table gives what formatting per request gave, for small fleets (the table)
    /// and large ones (formatted per request), in every output mode.
    #[test]
    fn destinations_are_the_formatted_values() {
        let mut checked = 0;
        for n in [1usize, 3, Destinations::MAX_PAIR_TABLE + 1] {
            for extra in [
                r#""output":"destination_header""#,
                r#""output":"destination_header","retry_backup":false"#,
                r#""output":"cluster_header""#,
                r#""output":"nginx_variable""#,
            ] {
                let replicas: Vec<String> = (0..n)
                    .map(|i| {
                        let cluster = if i % 2 == 0 { format!(r#","cluster":"c{i}""#) } else { String::new() };
                        format!(r#"{{"name":"r{i}","endpoint":"10.0.0.{i}:8000","feed_cluster":"f{i}"{cluster}}}"#)
                    })
                    .collect();
                let json = format!(r#"{{"replicas":[{}],{extra}}}"#, replicas.join(","));
                let Ok(cfg) = FilterConfig::from_json(json.as_bytes()) else {
                    continue;
                };
                let mut w = WorkerState::new(cfg.clone()).unwrap();
                let mut d = w.router.route_fallback(0);
                for (r, b) in [
                    (0, None),
                    (n - 1, Some(0)),
                    (0, Some(n - 1)),
                    (n / 2, Some(n / 3)),
                    (n + 5, Some(n + 9)),
                ] {
                    d.replica = r;
                    d.backup = b;
                    let last = n - 1;
                    let rep = &cfg.units[r.min(last)];
                    let want = match cfg.output {
                        OutputMode::ClusterHeader => {
                            rep.cluster.clone().unwrap_or_else(|| rep.endpoint.clone())
                        }
                        OutputMode::NginxVariable => rep.endpoint.clone(),
                        OutputMode::DestinationHeader => match b.filter(|_| cfg.retry_backup) {
                            Some(b) => {
                                format!("{},{}", rep.endpoint, cfg.units[b.min(last)].endpoint)
                            }
                            None => rep.endpoint.clone(),
                        },
                    };
                    assert_eq!(w.destination(&d), want, "{json} {r} {b:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked >= 30, "{checked} configurations checked");
    }

    /// A DP rank's value is its rank; a plain unit and one out of range have none.
    #[test]
    fn rank_values_are_formatted_per_unit() {
        let json = r#"{"replicas":[
            {"name":"e0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","dp_ranks":2},
            {"name":"e1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}]}"#;
        let d = Destinations::new(&FilterConfig::from_json(json.as_bytes()).unwrap());
        assert_eq!(
            (d.rank(0), d.rank(1), d.rank(2)),
            (Some("0"), Some("1"), None)
        );
        assert_eq!(d.rank(3), None);
    }

    #[test]
    fn the_destination_header_lists_a_backup_for_retries() {
        let mut w = worker("kv_load");
        let d = w.route_body(1, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 0);
        let v = w.destination(&d);
        let parts: Vec<&str> = v.split(',').collect();
        assert_eq!(parts.len(), 2, "{v}");
        assert_ne!(parts[0], parts[1]);
        w.cfg.retry_backup = false;
        assert!(!w.destination(&d).contains(','));
    }
}
