//! The `kvcached` command line: configuration from defaults, file, environment and flags, then
//! [`crate::serve`] until SIGTERM / SIGINT. The binary (`main.rs`) only calls [`main`].

use std::path::PathBuf;
use std::process::ExitCode;

use crate::{Config, Listeners, ServerError};
use clap::{Parser, Subcommand};

/// kvcached: the per-node KV-cache block daemon (G2 host memory, G3 disk) for LLM engines.
///
/// Configuration comes from embedded defaults, then --config FILE (TOML), then KVCACHED_*
/// environment variables, then these flags. `kvcached config` prints the result.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// TOML configuration file (see docs/configuration.md).
    #[arg(long, env = "KVCACHED_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Unix socket engines connect to.
    #[arg(long, env = "KVCACHED_SOCKET", global = true)]
    socket: Option<PathBuf>,
    /// Permission bits of the socket, octal (e.g. 0660).
    #[arg(long, env = "KVCACHED_SOCKET_MODE", global = true)]
    socket_mode: Option<String>,
    /// TCP address of the gRPC API (off unless set); it serves only Health. Who may call it:
    /// [tcp_auth] in the config file (needed on a non-loopback address).
    #[arg(long, env = "KVCACHED_TCP", global = true)]
    tcp: Option<std::net::SocketAddr>,
    /// HTTP address of /metrics, /healthz and the routers' recovery routes. Who may call it:
    /// [metrics_auth] in the config file (needed on a non-loopback address).
    #[arg(long, env = "KVCACHED_METRICS_ADDR", global = true)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// G2 host pool size in bytes (0: a quarter of memory, at most 64 GiB).
    #[arg(long, env = "KVCACHED_G2_CAPACITY_BYTES", global = true)]
    g2_capacity_bytes: Option<u64>,
    /// Directory of the G2 shared-memory file.
    #[arg(long, env = "KVCACHED_G2_SHM_DIR", global = true)]
    g2_shm_dir: Option<PathBuf>,
    /// Lock the G2 pool in memory (needs RLIMIT_MEMLOCK).
    #[arg(long, env = "KVCACHED_G2_MLOCK", global = true)]
    g2_mlock: Option<bool>,
    /// Enable the G3 disk tier.
    #[arg(long, env = "KVCACHED_G3_ENABLED", global = true)]
    g3_enabled: Option<bool>,
    /// G3 data directory.
    #[arg(long, env = "KVCACHED_G3_DIR", global = true)]
    g3_dir: Option<PathBuf>,
    /// G3 size in bytes (0: a quarter of the free space, at most 256 GiB).
    #[arg(long, env = "KVCACHED_G3_CAPACITY_BYTES", global = true)]
    g3_capacity_bytes: Option<u64>,
    /// G3 I/O backend: auto, io_uring or psync.
    #[arg(long, env = "KVCACHED_G3_IO_BACKEND", global = true)]
    g3_io_backend: Option<String>,
    /// fdatasync each G3 write batch.
    #[arg(long, env = "KVCACHED_G3_FSYNC", global = true)]
    g3_fsync: Option<bool>,
    /// Enable G4, the object-storage tier (needs --g4-url).
    #[arg(long, env = "KVCACHED_G4_ENABLED", global = true)]
    g4_enabled: Option<bool>,
    /// G4 location: s3://BUCKET/PREFIX or file:///PATH.
    #[arg(long, env = "KVCACHED_G4_URL", global = true)]
    g4_url: Option<String>,
    /// S3-compatible endpoint of G4 (credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
    #[arg(long, env = "KVCACHED_G4_ENDPOINT", global = true)]
    g4_endpoint: Option<String>,
    /// Region of the G4 bucket.
    #[arg(long, env = "KVCACHED_G4_REGION", global = true)]
    g4_region: Option<String>,
    /// Allow an http:// G4 endpoint.
    #[arg(long, env = "KVCACHED_G4_ALLOW_HTTP", global = true)]
    g4_allow_http: Option<bool>,
    /// Address of the peer channel other daemons pull blocks from (e.g. 0.0.0.0:7471).
    #[arg(long, env = "KVCACHED_PEER_LISTEN", global = true)]
    peer_listen: Option<std::net::SocketAddr>,
    /// host:port other daemons dial to reach the peer channel.
    #[arg(long, env = "KVCACHED_PEER_ADVERTISE", global = true)]
    peer_advertise: Option<String>,
    /// Sources loads and hints may name beyond peer.peers: host:port or networks such as
    /// 10.0.0.0/8 (comma-separated).
    #[arg(long, env = "KVCACHED_PEER_ALLOWED_SOURCES", global = true, value_delimiter = ',')]
    peer_allowed_sources: Option<Vec<String>>,
    /// Most engines attached at once.
    #[arg(long, env = "KVCACHED_MAX_ENGINES", global = true)]
    max_engines: Option<usize>,
    /// Drop an engine silent for this many milliseconds.
    #[arg(long, env = "KVCACHED_ENGINE_LEASE_MS", global = true)]
    engine_lease_ms: Option<u64>,
    /// kvrouter base URLs to publish hit reports to (comma-separated).
    #[arg(long, env = "KVCACHED_ROUTER_URLS", global = true, value_delimiter = ',')]
    router_urls: Option<Vec<String>>,
    /// This node's name in the cluster (default: the host name).
    #[arg(long, env = "KVCACHED_NODE", global = true)]
    node: Option<String>,
    /// How hit reports travel: http (router URLs), nats, or both (a migration).
    #[arg(long, env = "KVCACHED_EVENTS_TRANSPORT", global = true, value_parser = ["http", "nats", "both"])]
    events_transport: Option<String>,
    /// NATS server URLs of the event plane (comma-separated).
    #[arg(long, env = "KVCACHED_EVENTS_NATS_SERVERS", global = true, value_delimiter = ',')]
    events_nats_servers: Option<Vec<String>>,
    /// The deployment's name on the event plane (the subject token after the prefix).
    #[arg(long, env = "KVCACHED_EVENTS_NATS_CLUSTER", global = true)]
    events_nats_cluster: Option<String>,
    /// Log format on stderr: text (colour only on a terminal) or json (one object per line, for
    /// log collectors). The level comes from RUST_LOG (default info).
    #[arg(long, env = "KVCACHED_LOG_FORMAT", global = true, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon (the default).
    Run,
    /// Print the effective configuration as TOML and exit.
    Config,
}

impl Cli {
    fn config(&self) -> Result<Config, ServerError> {
        let mut c = match &self.config {
            Some(p) => Config::from_file(p)?,
            None => Config::default(),
        };
        macro_rules! set {
            ($flag:expr => $($field:tt)+) => {
                if let Some(v) = $flag.clone() {
                    c.$($field)+ = v;
                }
            };
        }
        set!(self.socket => socket);
        set!(self.socket_mode => socket_mode);
        if self.tcp.is_some() {
            c.tcp = self.tcp;
        }
        set!(self.metrics_addr => metrics_addr);
        set!(self.g2_capacity_bytes => g2.capacity_bytes);
        set!(self.g2_shm_dir => g2.shm_dir);
        set!(self.g2_mlock => g2.mlock);
        set!(self.g3_enabled => g3.enabled);
        set!(self.g3_dir => g3.dir);
        set!(self.g3_capacity_bytes => g3.capacity_bytes);
        set!(self.g3_io_backend => g3.io_backend);
        set!(self.g3_fsync => g3.fsync);
        set!(self.g4_enabled => g4.enabled);
        set!(self.g4_url => g4.url);
        set!(self.g4_endpoint => g4.endpoint);
        set!(self.g4_region => g4.region);
        set!(self.g4_allow_http => g4.allow_http);
        if self.peer_listen.is_some() {
            c.peer.listen = self.peer_listen;
        }
        set!(self.peer_advertise => peer.advertise);
        set!(self.peer_allowed_sources => peer.allowed_sources);
        set!(self.max_engines => engines.max_engines);
        set!(self.engine_lease_ms => engines.lease_ms);
        set!(self.router_urls => router.urls);
        set!(self.node => router.node);
        set!(self.events_transport => events.transport);
        set!(self.events_nats_servers => events.nats.servers);
        set!(self.events_nats_cluster => events.nats.cluster);
        c.resolve()
    }
}

/// Runs the command line given to this process; the exit code says how it ended (2: invalid
/// configuration).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    kvnet::process::init_logging(&cli.log_format);
    let json = cli.log_format == "json";
    let config = match cli.config() {
        Ok(c) => c,
        Err(ServerError::Config { field, reason }) => {
            say(json, true, &format!("kvcached: invalid configuration: {field}: {reason}"));
            return ExitCode::from(2);
        }
        Err(e) => {
            say(json, true, &format!("kvcached: invalid configuration: {e}"));
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            say(json, true, &format!("kvcached: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command.unwrap_or(Command::Run) {
        Command::Config => {
            print!("{}", config.to_toml());
            Ok(())
        }
        Command::Run => rt
            .block_on(async {
                let shutdown = kvnet::process::shutdown_signal();
                let listeners = Listeners::bind(&config).await?;
                let socket = config.socket.clone();
                let scheme = if config.metrics_auth.tls() { "https" } else { "http" };
                // Printed once the daemon serves: a start that fails says only why.
                let banner = move |http: Option<std::net::SocketAddr>| {
                    let metrics = http.map_or_else(|| "none".into(), |a| format!("{scheme}://{a}/metrics"));
                    say(
                        json,
                        false,
                        &format!(
                            "kvcached listening on {} (metrics {metrics}); try `cargo run --release -p kvclient --example demo` in another shell",
                            socket.display()
                        ),
                    );
                };
                crate::serve_announcing(config, listeners, shutdown, banner).await
            })
            .map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(json, true, &format!("kvcached: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// A line for whoever started the daemon, on stderr: as it is for a person, or as a log event
/// with `--log-format json`, so that every line a log collector reads is one JSON object.
fn say(json: bool, error: bool, line: &str) {
    match (json, error) {
        (false, _) => eprintln!("{line}"),
        (true, false) => tracing::info!("{line}"),
        (true, true) => tracing::error!("{line}"),
    }
}
