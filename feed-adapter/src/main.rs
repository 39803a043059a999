//! `kvsteer-feed`: the feed adapter beside one engine replica. `kvsteer-feed --help` lists the flags;
//! docs/guide/feed-adapter.md explains them.

use clap::Parser;
use kvsteer_feed::config::{Args, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.print_bundle_sha256 {
        let dir = args
            .model_dir
            .as_deref()
            .unwrap_or(std::path::Path::new("."));
        return match kvsteer_feed::bundle::load(dir, args.model_name.as_deref()) {
            Ok(b) => {
                println!("{}", b.sha256);
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvsteer-feed: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match args.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    let Some(rt) = kvsteer_feed::run::runtime(2) else {
        return std::process::ExitCode::FAILURE;
    };
    rt.block_on(async {
        let running = match kvsteer_feed::run::start(args).await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "cannot start");
                return std::process::ExitCode::FAILURE;
            }
        };
        shutdown_signal().await;
        tracing::info!("shutting down");
        drop(running);
        std::process::ExitCode::SUCCESS
    })
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
