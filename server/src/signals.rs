//! Process signals: SIGTERM and SIGINT start the graceful shutdown.

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
