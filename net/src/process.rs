//! What the workspace's daemons (`kvcached`, `kvrouter`) do alike as processes: their logging on
//! stderr, SIGTERM / SIGINT starting the graceful shutdown, and tasks that end with their owner.

/// Logs on stderr, filtered by `RUST_LOG` (default `info`): plain text without colour codes when
/// stderr is not a terminal (a file, a pipe, a container's log), or JSON lines when `format` is
/// `json`.
pub fn init_logging(format: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == "json" {
        fmt.json().init();
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// Installs the SIGTERM (what orchestrators send) and SIGINT handlers now, before anything
/// listens, so that a signal that arrives right after start still shuts down cleanly, and
/// returns the future that resolves on either. Call it inside the runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => Some((term, int)),
        _ => {
            tracing::warn!("cannot install signal handlers; stop with SIGKILL");
            None
        }
    };
    async move {
        let Some((mut term, mut int)) = handlers else { return std::future::pending().await };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = int.recv() => tracing::info!("SIGINT"),
        }
    }
}

/// A task aborted when this is dropped (a reader goes with what it reads for).
#[derive(Debug)]
pub struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
