//! `kvlease-proxy`: routes each completion request to a prefill agent, then to a decode
//! agent with the prefill's `kv_transfer_params`, or, with `--transfer-mode push`, to both
//! at once tied by a transfer id (see `kvlease_agent::proxy`).

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use kvlease_agent::proxy::{Proxy, ProxyArgs};
use kvlease_agent::telemetry;

fn main() -> ExitCode {
    let args = ProxyArgs::parse();
    if let Err(error) = telemetry::init_with_format("info", args.log_format) {
        eprintln!("kvlease-proxy: {error}");
        return ExitCode::from(2);
    }
    let config = match args.config() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvlease-proxy: {error}");
            return ExitCode::from(2);
        }
    };
    let result = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")
        .and_then(|runtime| runtime.block_on(run(&args, config)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvlease-proxy: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &ProxyArgs, config: kvlease_agent::proxy::ProxyConfig) -> anyhow::Result<()> {
    let (prefill, decode) = (config.prefill.len(), config.decode.len());
    let proxy = Proxy::new(config)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("--port: cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener
        .local_addr()
        .context("reading the listening address")?;
    tracing::info!(%addr, prefill, decode, "kvlease-proxy listening");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        served = proxy.serve(listener) => served.context("serving")?,
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; exiting"),
        _ = terminate.recv() => tracing::info!("terminated; exiting"),
    }
    Ok(())
}
