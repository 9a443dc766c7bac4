//! A root daemon in this process (`kvcached::serve` on a temp socket and port 0) whose socket
//! (mode 0666) and directory other uids can reach: the scenarios with hostile clients and
//! tenants of other uids (`security.rs`, `tenants.rs`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvcached::{Config, Listeners};

/// Whether this process runs as root (the tests that play another uid need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Returns from the test (after saying it is skipped, and that it needs root `$why`) unless
/// this process runs as root: the tests that play other uids.
#[macro_export]
macro_rules! require_root {
    ($why:literal) => {
        if !$crate::inproc::is_root() {
            eprintln!(concat!("skipped: needs root ", $why));
            return;
        }
    };
}

/// The daemon; [`InProcess::stop`] shuts it down and checks it ended cleanly.
#[derive(Debug)]
pub struct InProcess {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub http: std::net::SocketAddr,
    pub tcp: Option<std::net::SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvcached::ServerError>>,
}

impl InProcess {
    /// Starts it with a 64 MiB G2 and no G3, after `tune`.
    pub async fn start(tune: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
        let mut c = Config {
            socket: dir.path().join("kvcached.sock"),
            socket_mode: "0666".into(),
            metrics_addr: "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")),
            ..Default::default()
        };
        c.g2.capacity_bytes = 64 << 20;
        c.g2.shm_dir = dir.path().to_path_buf();
        c.g3.enabled = false;
        tune(&mut c);
        let c = c.resolve().unwrap_or_else(|e| panic!("{e}"));
        let l = Listeners::bind(&c).await.unwrap_or_else(|e| panic!("{e}"));
        let http = l.http.as_ref().and_then(|h| h.local_addr().ok()).unwrap_or_else(|| panic!("no HTTP listener"));
        let tcp = l.tcp.as_ref().and_then(|t| t.local_addr().ok());
        let socket = c.socket.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(kvcached::serve(c, l, async move {
            let _ = rx.await;
        }));
        Self { dir, socket, http, tcp, stop: Some(tx), task }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let ended = (&mut self.task).await.unwrap_or_else(|e| panic!("the daemon's task: {e}"));
        ended.unwrap_or_else(|e| panic!("the daemon ended with {e}"));
    }

    /// `bin SOCKET ARGS` as `uid` (and its gid), from a copy of `bin` in the daemon's directory
    /// that other uids can execute.
    pub fn as_uid(&self, bin: &Path, uid: u32, args: &[&str]) -> Command {
        let copy = self.dir.path().join(bin.file_name().unwrap_or_else(|| panic!("{}", bin.display())));
        if !copy.exists() {
            std::fs::copy(bin, &copy).unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap_or_else(|e| panic!("{e}"));
        }
        let mut c = Command::new(&copy);
        c.arg(&self.socket).args(args).uid(uid).gid(uid);
        c
    }

    /// [`InProcess::as_uid`] run to its end: its stdout, trimmed (it must succeed).
    pub fn say_as(&self, bin: &Path, uid: u32, args: &[&str]) -> String {
        let mut c = self.as_uid(bin, uid, args);
        let out = retry_busy(|| c.output()).unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        assert!(out.status.success(), "{} {args:?}: {out:?}", bin.display());
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The sum of the `/metrics` lines starting with `series` (a name, or a name and labels).
    pub async fn metric(&self, series: impl AsRef<str>) -> f64 {
        let series = series.as_ref();
        let text = reqwest::get(format!("http://{}/metrics", self.http))
            .await
            .and_then(|r| r.error_for_status())
            .unwrap_or_else(|e| panic!("{e}"))
            .text()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    }

    pub async fn healthz(&self) -> u16 {
        reqwest::get(format!("http://{}/healthz", self.http)).await.map_or(0, |r| r.status().as_u16())
    }
}

/// Runs `start` (a spawn of a program copied by [`InProcess::as_uid`]) again while it fails with
/// ETXTBSY: a process forked by another test while the copy was open for writing holds that
/// descriptor until it execs, and the kernel refuses to run the file meanwhile.
pub fn retry_busy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let mut tries = 0;
    loop {
        match start() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r,
        }
    }
}
