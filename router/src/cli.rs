//! The `kvrouter` command line: configuration from a TOML file, flags and environment, then
//! [`crate::serve`] until SIGTERM / SIGINT ([`kvnet::process::shutdown_signal`]). The binary only calls [`main`].

use std::path::PathBuf;

use crate::{RouterConfig, RoutingMode};
use clap::Parser;

/// The kvcached cluster router.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Address of the HTTP API.
    #[arg(long, env = "KVROUTER_LISTEN", default_value = "127.0.0.1:8090")]
    listen: String,
    /// TOML configuration file (every field optional; see docs/router.md).
    #[arg(long, env = "KVROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// Route on the router's own decisions (no events).
    #[arg(long)]
    approximate: bool,
    /// NATS server URLs of the event plane to read (comma-separated; `[nats]` in the file).
    #[arg(long, env = "KVROUTER_NATS_SERVERS", value_delimiter = ',')]
    nats_servers: Option<Vec<String>>,
    /// The deployment whose nodes to read (`nats.cluster`).
    #[arg(long, env = "KVROUTER_NATS_CLUSTER")]
    nats_cluster: Option<String>,
    /// The NATS user (`nats.auth.user`), with `--nats-password-file`.
    #[arg(long, env = "KVROUTER_NATS_USER")]
    nats_user: Option<String>,
    /// A file whose first line is the NATS user's password (`nats.auth.password_file`).
    #[arg(long, env = "KVROUTER_NATS_PASSWORD_FILE")]
    nats_password_file: Option<PathBuf>,
    /// Log format on stderr: text (colour only on a terminal) or json (one object per line).
    #[arg(long, env = "KVROUTER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

/// Runs the command line given to this process.
pub fn main() -> std::process::ExitCode {
    let args = Args::parse();
    kvnet::process::init_logging(&args.log_format);
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("kvrouter: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), crate::RouterError> {
    let mut config = match &args.config {
        Some(p) => RouterConfig::from_toml(&std::fs::read_to_string(p)?)?,
        None => RouterConfig::default(),
    };
    if args.approximate {
        config.mode = RoutingMode::Approximate;
    }
    if let Some(s) = args.nats_servers {
        config.nats.servers = s;
    }
    if let Some(c) = args.nats_cluster {
        config.nats.cluster = c;
    }
    if let Some(u) = args.nats_user {
        config.nats.auth.user = Some(u);
    }
    if let Some(p) = args.nats_password_file {
        config.nats.auth.password_file = Some(p);
    }
    config.validate()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let shutdown = kvnet::process::shutdown_signal();
        let listener = tokio::net::TcpListener::bind(&args.listen).await?;
        crate::serve(listener, config, shutdown).await
    })
}
