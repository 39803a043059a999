//! What goes into the harness and what it keeps of each request: a request's spec, its record, and
//! the harness's counters. Plain data, so tests can build specs and read records and counters
//! without knowing how the harness drives the filter.

/// A request for [`Harness::send`](super::Harness::send).
#[derive(Clone, Debug, Default)]
pub struct RequestSpec {
    pub session: Option<String>,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Worker to use (default: round robin).
    pub worker: Option<usize>,
    /// More request headers (e.g. a spoofed destination header).
    pub headers: Vec<(String, String)>,
    /// Send these bytes instead of a completions body built from `prompt` (malformed-input tests).
    pub raw_body: Option<Vec<u8>>,
    /// Path (default `/v1/completions`).
    pub path: Option<String>,
    /// End the request with these trailers (HTTP/2): end of stream then arrives on
    /// `proxy_on_request_trailers`, not on the last body chunk.
    pub trailers: Option<Vec<(String, String)>>,
    /// The proxy answers the request itself once the filter released it, instead of any replica
    /// (the harness's imitation of Envoy's answers to an oversized body: [`ProxyAnswer`]).
    pub proxy_answer: Option<ProxyAnswer>,
    /// The body's OpenAI `model` (default: the simulator's served name); another name asks the
    /// engine for that LoRA adapter.
    pub model: Option<String>,
}

/// The harness's imitation of Envoy answering a request itself after the filter released it and
/// an upstream host was picked (`upstream.address` set): the status and the `response.code_details`
/// Envoy 1.40 gives. What it does with a body over its 16 MiB buffers: its retry buffer overflows
/// ([`ProxyAnswer::RETRY_BUFFER_OVERFLOW`]), or the replica, refusing the body, cuts the
/// connection ([`ProxyAnswer::CONNECTION_CUT`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ProxyAnswer {
    pub status: u16,
    pub details: String,
}

impl ProxyAnswer {
    pub const RETRY_BUFFER_OVERFLOW: (u16, &'static str) =
        (507, "request_payload_exceeded_retry_buffer_limit");
    pub const CONNECTION_CUT: (u16, &'static str) = (
        503,
        "upstream_reset_before_response_started{connection_termination}",
    );

    pub fn new((status, details): (u16, &str)) -> ProxyAnswer {
        ProxyAnswer {
            status,
            details: details.to_string(),
        }
    }
}

impl RequestSpec {
    pub fn new(prompt: Vec<u32>, max_tokens: u32) -> RequestSpec {
        RequestSpec {
            prompt,
            max_tokens,
            ..Default::default()
        }
    }

    pub fn model(mut self, m: &str) -> Self {
        self.model = Some(m.to_string());
        self
    }

    pub fn session(mut self, s: &str) -> Self {
        self.session = Some(s.to_string());
        self
    }

    pub fn worker(mut self, w: usize) -> Self {
        self.worker = Some(w);
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }

    /// The proxy answers the request itself once released ([`ProxyAnswer`]).
    pub fn proxy_answer(mut self, a: ProxyAnswer) -> Self {
        self.proxy_answer = Some(a);
        self
    }

    /// Ends the request with a trailer (HTTP/2 request trailers).
    pub fn trailer(mut self, k: &str, v: &str) -> Self {
        self.trailers
            .get_or_insert_with(Vec::new)
            .push((k.to_string(), v.to_string()));
        self
    }
}

/// What happened to one request.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    pub id: u64,
    pub worker: usize,
    pub issued_us: u64,
    /// The filter let the request go upstream.
    pub released: bool,
    /// The destination the filter chose, as written (header value or nginx variable).
    pub destination: Option<String>,
    /// The replica that served it (chosen by the filter, or by fallback; after a retry, the one
    /// retried on).
    pub replica: Option<usize>,
    /// The filter's choice, when it failed the request at once and the proxy retried elsewhere
    /// ([`HarnessConfig::retry_5xx`](super::HarnessConfig::retry_5xx)).
    pub retried_from: Option<usize>,
    /// Released without a usable destination: the proxy's own balancing picked the replica.
    pub fallback: bool,
    /// The filter answered locally with this status.
    pub local_response: Option<u32>,
    /// That local answer's headers and body, as the client receives them.
    pub local_headers: Vec<(String, String)>,
    pub local_body: Vec<u8>,
    /// The engine refused the request (400 passed back through the filter).
    pub rejected: Option<String>,
    pub first_token_us: Option<u64>,
    pub finished_us: Option<u64>,
    pub failed: bool,
    /// Prompt tokens the engine reported (0 until the request finishes).
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    /// Request headers as the upstream saw them.
    pub upstream_headers: Vec<(String, String)>,
    /// Response body bytes that reached the client.
    pub downstream_bytes: usize,
    /// The filter's `explain_header` on the response, when configured (the routing cost's terms).
    pub explained: Option<String>,
}

impl RequestRecord {
    pub fn upstream_header(&self, name: &str) -> Option<&str> {
        self.upstream_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Counters of what the harness did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarnessStats {
    /// Wall time of the longest single `proxy_on_tick` or callout answer (`proxy_on_http_call_response`)
    /// in any worker: the longest the filter held a worker thread for feed work (benchmarks read it;
    /// tests never time anything).
    pub max_feed_call_ns: u64,
    pub requests: u64,
    /// Requests retried on the filter's second choice
    /// ([`HarnessConfig::retry_5xx`](super::HarnessConfig::retry_5xx)).
    pub retries: u64,
    pub fallback: u64,
    pub local_responses: u64,
    /// Requests the proxy answered itself after the filter released them ([`ProxyAnswer`]).
    pub proxy_answers: u64,
    pub rejected: u64,
    pub failed: u64,
    pub ticks: u64,
    pub callouts: u64,
    pub request_body_chunks: u64,
    pub response_body_chunks: u64,
    /// Wall time spent inside guest callbacks for requests (headers + body), nanoseconds.
    pub request_filter_ns: u64,
    /// Requests the oracle placed ([`HarnessConfig::oracle`](super::HarnessConfig::oracle)), and of
    /// those, how many on another replica than the filter chose.
    pub oracle_placed: u64,
    pub oracle_moved: u64,
    /// With DP ranks: requests whose rank came from the rank header, and from the endpoint's own
    /// balancer (no header, or not a rank of the endpoint).
    pub rank_from_header: u64,
    pub rank_from_balancer: u64,
    /// Peer polls (the working-set exchange) answered through the peer proxy's filter, and those
    /// the filter let through instead of answering (never: the reserved path is not forwarded).
    pub peer_polls: u64,
    pub peer_polls_forwarded: u64,
    /// Body bytes of the peer polls' answers (what the exchange puts on the wire, headers aside).
    pub peer_answer_bytes: u64,
    /// The filters' own exchange counters over every proxy (`kvsteer_peer_entries_applied`,
    /// `kvsteer_peer_answers_refused`), as of
    /// [`Harness::collect_peer_counters`](super::Harness::collect_peer_counters).
    pub peer_entries_applied: u64,
    pub peer_answers_refused: u64,
}
