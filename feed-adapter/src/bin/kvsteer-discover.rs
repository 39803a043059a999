//! `kvsteer-discover`: answers the filter's discovery polls with the fleet's member list, from a
//! file or a Kubernetes headless Service resolved by DNS (docs/design/discovery.md).

use clap::Parser;
use kvsteer_feed::discover::{DnsSource, Source, app};
use std::net::SocketAddr;
use std::path::PathBuf;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "kvsteer-discover",
    about = "Serves the fleet's member list to kvsteer's discovery"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:9090")]
    listen: SocketAddr,
    /// Serve the document in this file (read again on every request).
    #[arg(long, conflicts_with = "dns")]
    members_file: Option<PathBuf>,
    /// Serve one member per address of this DNS name (a headless Service).
    #[arg(long, required_unless_present = "members_file")]
    dns: Option<String>,
    /// With --dns: the engine's serving port on every pod.
    #[arg(long, default_value_t = 8000)]
    serving_port: u16,
    /// With --dns: the feed's port on every pod (omit when the engine serves its own feed).
    #[arg(long)]
    feed_port: Option<u16>,
    /// With --dns: data-parallel ranks every pod serves.
    #[arg(long, default_value_t = 1)]
    ranks: u32,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let source = match (args.members_file, args.dns) {
        (Some(path), _) => Source::File(path),
        (None, Some(name)) => Source::Dns(DnsSource {
            name,
            serving_port: args.serving_port,
            feed_port: args.feed_port,
            ranks: args.ranks,
        }),
        (None, None) => unreachable!("clap requires one source"),
    };
    let Some(rt) = kvsteer_feed::run::runtime(1) else {
        return std::process::ExitCode::FAILURE;
    };
    rt.block_on(async move {
        let app = match app(source) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return std::process::ExitCode::FAILURE;
            }
        };
        let listener = match tokio::net::TcpListener::bind(args.listen).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, listen = %args.listen, "cannot listen");
                return std::process::ExitCode::FAILURE;
            }
        };
        tracing::info!(listen = %args.listen, "serving the member list");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        match axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "server failed");
                std::process::ExitCode::FAILURE
            }
        }
    })
}
