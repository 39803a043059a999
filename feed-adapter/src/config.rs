//! Command-line configuration (`kvsteer-feed --help`).

use clap::{Parser, ValueEnum};
use std::net::SocketAddr;

/// How the adapter's SUB socket meets the engine's PUB socket.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ZmqMode {
    /// `bind` when the endpoint has no `*` (vLLM then connects to it), else `connect` to it with `*`
    /// read as 127.0.0.1 (vLLM binds `tcp://*:PORT`). Pass the same string as vLLM's `endpoint`.
    Auto,
    /// The adapter binds; the engine connects (vLLM with `tcp://HOST:PORT`).
    Bind,
    /// The adapter connects; the engine binds (vLLM with `tcp://*:PORT`).
    Connect,
}

/// Runs beside one engine replica (vLLM, SGLang): subscribes to its ZMQ KV cache events, computes
/// kvsteer's block identities from their token ids, scrapes the engine's /metrics for load, and serves
/// the kvsteer feed (GET /kvsteer/feed) that the router polls. See docs/guide/feed-adapter.md.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvsteer-feed", version)]
pub struct Args {
    /// Address the feed, /metrics and /health are served on.
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub listen: SocketAddr,

    /// The engine's KV events endpoint, as in its `--kv-events-config` `endpoint`.
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub zmq_endpoint: String,

    /// Whether to bind or connect the SUB socket.
    #[arg(long, value_enum, default_value = "auto")]
    pub zmq_mode: ZmqMode,

    /// Topic to subscribe to (the engine's `topic`); empty subscribes to every topic.
    #[arg(long, default_value = "")]
    pub topic: String,

    /// The engine's replay endpoint (its `replay_endpoint`, a ROUTER socket), used to fetch missed
    /// batches after a sequence gap. `*` is read as 127.0.0.1. Without it a gap resets the view.
    #[arg(long)]
    pub replay_endpoint: Option<String>,

    /// How long one replay request may take, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub replay_timeout_ms: u64,

    /// The engine's Prometheus endpoint, e.g. http://127.0.0.1:8000/metrics (load fields, block size,
    /// block count, restarts). Without it the feed reports no load.
    #[arg(long)]
    pub metrics_url: Option<String>,

    /// How often the engine's /metrics is scraped, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub scrape_interval_ms: u64,

    /// Answer the feed with 503 (the router then treats the replica as stale) when the engine's
    /// /metrics has not answered for this many seconds after answering once; 0 never does.
    #[arg(long, default_value_t = 10)]
    pub stale_after_s: u64,

    /// Tokens per KV block; must equal the engine's `--block-size` (SGLang: `--page-size`) and the
    /// router's `block_size`. Default: learned from the engine's /metrics, else from its first event.
    #[arg(long)]
    pub block_size: Option<usize>,

    /// Most engine blocks held in memory (about 70 bytes each); past it the oldest stored are dropped
    /// and reported removed. Default: 2 x the engine's num_gpu_blocks (at least 4,096), 1,048,576 until
    /// that is known.
    #[arg(long)]
    pub max_blocks: Option<usize>,

    /// Block hashes the feed log keeps for routers that fall behind (8 bytes each); a router further
    /// behind gets a snapshot.
    #[arg(long, default_value_t = crate::state::DEFAULT_LOG_HASHES)]
    pub log_hashes: usize,

    /// KV cache group indexed (hybrid models publish one per group); events of other groups are skipped.
    #[arg(long, default_value_t = 0)]
    pub group_idx: i64,

    /// Largest engine payload accepted, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_payload_bytes: usize,

    /// Most events in one engine batch.
    #[arg(long, default_value_t = 100_000)]
    pub max_batch_events: usize,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Data-parallel ranks of the engine (vLLM `--data-parallel-size` behind one API server): each
    /// rank publishes on the endpoint's port plus its rank (and replays likewise), so the adapter
    /// subscribes to each and serves each rank's feed at `/kvsteer/feed?rank=R` (the router's
    /// replica entry then has the same `dp_ranks`). 1: one engine, as before.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub dp_ranks: u32,

    /// The engine's model folder: its `tokenizer.json` and `tokenizer_config.json` are served at
    /// GET /kvsteer/tokenizer for routers that fetch the bundle (`tokenizer.huggingface.fetch`);
    /// read once at start, the SHA-256 of the answer logged.
    #[arg(long)]
    pub model_dir: Option<std::path::PathBuf>,

    /// The model name written into the bundle (the router's `fetch.model` checks it).
    #[arg(long, requires = "model_dir")]
    pub model_name: Option<String>,

    /// Print the bundle's SHA-256 (for the router's `fetch.sha256`) and exit.
    #[arg(long, requires = "model_dir")]
    pub print_bundle_sha256: bool,
}

/// vLLM's per-rank endpoint (`ZmqEventPublisher.offset_endpoint_port` in
/// `vllm/distributed/kv_events.py`): a `tcp://` endpoint's port plus the rank; rank 0 unchanged.
/// Other transports cannot be offset by a port: an error naming the endpoint.
pub fn offset_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    let bad = || {
        format!(
            "{endpoint:?}: DP ranks need a tcp://HOST:PORT endpoint (rank {rank} publishes on PORT + {rank})"
        )
    };
    if !endpoint.starts_with("tcp://") {
        return Err(bad());
    }
    let (base, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
    let port: u32 = port.parse().map_err(|_| bad())?;
    let p = port + rank;
    if p > u16::MAX as u32 {
        return Err(bad());
    }
    Ok(format!("{base}:{p}"))
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The endpoint the SUB socket uses and whether it binds.
pub fn sub_endpoint(endpoint: &str, mode: ZmqMode) -> (String, bool) {
    let has_star = endpoint.contains('*');
    let bind = match mode {
        ZmqMode::Auto => !has_star,
        ZmqMode::Bind => true,
        ZmqMode::Connect => false,
    };
    let ep = if bind {
        endpoint.replace('*', "0.0.0.0")
    } else {
        endpoint.replace('*', "127.0.0.1")
    };
    (ep, bind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_vllm_convention() {
        assert_eq!(
            sub_endpoint("tcp://127.0.0.1:5557", ZmqMode::Auto),
            ("tcp://127.0.0.1:5557".into(), true)
        );
        assert_eq!(
            sub_endpoint("tcp://*:5557", ZmqMode::Auto),
            ("tcp://127.0.0.1:5557".into(), false)
        );
        assert_eq!(
            sub_endpoint("tcp://*:5557", ZmqMode::Bind),
            ("tcp://0.0.0.0:5557".into(), true)
        );
        assert_eq!(
            sub_endpoint("tcp://10.0.0.1:5557", ZmqMode::Connect),
            ("tcp://10.0.0.1:5557".into(), false)
        );
    }

    #[test]
    fn rank_endpoints_follow_vllms_port_offset() {
        assert_eq!(offset_endpoint("tcp://*:5557", 0).unwrap(), "tcp://*:5557");
        assert_eq!(offset_endpoint("tcp://*:5557", 3).unwrap(), "tcp://*:5560");
        assert_eq!(
            offset_endpoint("tcp://127.0.0.1:5558", 1).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert!(offset_endpoint("ipc:///tmp/kv", 1).is_err());
        assert!(offset_endpoint("tcp://*:65535", 1).is_err());
        assert!(Args::try_parse_from(["kvsteer-feed", "--dp-ranks", "0"]).is_err());
        assert_eq!(
            Args::try_parse_from(["kvsteer-feed", "--dp-ranks", "4"])
                .unwrap()
                .dp_ranks,
            4
        );
    }

    #[test]
    fn help_parses() {
        let a = Args::try_parse_from(["kvsteer-feed", "--block-size", "32"]).unwrap();
        assert_eq!(a.block_size, Some(32));
        assert!(Args::try_parse_from(["kvsteer-feed", "--zmq-mode", "sideways"]).is_err());
    }
}
