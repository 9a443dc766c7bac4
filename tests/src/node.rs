//! A `kvcached` process that keeps its configuration and directories across restarts (clean
//! ones and `kill -9`), with a fault file (`inject_faults`, `server/src/faults.rs`) the tests
//! switch faults with while it runs: the fault suites (`faults.rs`, `faults_remote.rs`) and the
//! crash loops (`crash.rs`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::proc::{DaemonProc, free_port};

/// G2 and G3 page sizes matching [`crate::oracle::layout`]'s 8 KiB blocks, G3 under `g3_dir`
/// with `capacity` bytes, no fdatasync unless `fsync`.
pub fn g3_toml(g3_dir: &Path, capacity: u64, fsync: bool) -> String {
    format!(
        "[g2]\npage_size = 8192\n[g3]\ndir = \"{}\"\ncapacity_bytes = {capacity}\npage_size = 8192\nfsync = {fsync}\n",
        g3_dir.display()
    )
}

/// A daemon process that can be restarted with the same configuration.
#[derive(Debug)]
pub struct Node {
    d: Option<DaemonProc>,
    bin: PathBuf,
    dir: PathBuf,
    toml: String,
    env: Vec<(String, String)>,
    /// The fault file it reads.
    pub faults: PathBuf,
}

impl Node {
    /// Starts `bin` (the `daemon` test binary) in `dir` with `toml` (tables only: the fault file
    /// comes first) and `env`.
    pub fn start(bin: &Path, dir: &Path, toml: &str, env: &[(&str, &str)]) -> Self {
        let faults = dir.join("faults.toml");
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        std::fs::write(&faults, "").unwrap_or_else(|e| panic!("{}: {e}", faults.display()));
        let mut n = Self {
            d: None,
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            toml: format!("inject_faults = \"{}\"\n{toml}", faults.display()),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            faults,
        };
        n.spawn(true);
        n
    }

    /// Starts the process; with `ready`, waits until it serves: its socket is bound before its
    /// store opens (and before the fault file is first read).
    fn spawn(&mut self, ready: bool) {
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let http = format!("127.0.0.1:{}", free_port());
        let d = DaemonProc::spawn(&self.bin, &self.dir, &http, &self.toml, None, &env);
        let deadline = Instant::now() + Duration::from_secs(30);
        while ready && !d.log().contains("kvcached serving") {
            assert!(Instant::now() < deadline, "the daemon did not open its store\n{}", d.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        self.d = Some(d);
    }

    /// The running process.
    pub fn d(&self) -> &DaemonProc {
        self.d.as_ref().unwrap_or_else(|| panic!("the daemon in {} is not running", self.dir.display()))
    }

    /// Its socket (the same across restarts).
    pub fn socket(&self) -> PathBuf {
        self.dir.join("kvcached.sock")
    }

    /// Stops it cleanly (SIGTERM: write-through drained, G3 flushed) and starts it again.
    pub fn restart(&mut self) {
        if let Some(d) = self.d.take() {
            d.stop();
        }
        self.spawn(true);
    }

    /// Stops it cleanly, to be started again with [`Node::start_again`].
    pub fn halt(&mut self) {
        if let Some(d) = self.d.take() {
            d.stop();
        }
    }

    /// SIGKILL now; returns the log of the process killed.
    pub fn kill9(&mut self) -> String {
        let mut d = self.d.take().unwrap_or_else(|| panic!("no daemon to kill in {}", self.dir.display()));
        d.kill9();
        d.log()
    }

    /// Starts it again after [`Node::kill9`] or [`Node::halt`]; returns once it serves.
    pub fn start_again(&mut self) {
        assert!(self.d.is_none(), "still running");
        self.spawn(true);
    }

    /// [`Node::start_again`], returning as soon as its socket is bound (its store may still be
    /// opening: a kill then crashes it during recovery).
    pub fn start_again_unready(&mut self) {
        assert!(self.d.is_none(), "still running");
        self.spawn(false);
    }

    /// Stops it cleanly for good.
    pub fn stop(mut self) {
        if let Some(d) = self.d.take() {
            d.stop();
        }
    }

    /// `GET /healthz`: (status, body).
    pub fn healthz(&self) -> (u16, String) {
        self.d().get("/healthz")
    }

    /// Waits until `/healthz` answers 503 with every one of `parts` in its body; returns it.
    pub fn wait_degraded(&self, parts: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let (status, body) = self.healthz();
            if status == 503 && parts.iter().all(|p| body.contains(p)) {
                return body;
            }
            assert!(Instant::now() < deadline, "/healthz never said {parts:?}: {status} {body}\n{}", self.d().log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/healthz` answers 200 (this node ready) with a `warning:` line holding
    /// every one of `parts` (a degraded neighbour); returns the body.
    pub fn wait_warning(&self, parts: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let (status, body) = self.healthz();
            if status == 200 && body.lines().any(|l| l.starts_with("warning: ") && parts.iter().all(|p| l.contains(p)))
            {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "/healthz never warned of {parts:?}: {status} {body}\n{}",
                self.d().log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Injects the faults `text` names (the fault file's TOML; "" for none) and waits until the
    /// daemon has read them.
    pub fn set_faults(&self, text: &str) {
        const APPLIED: &str = "injected faults changed";
        if std::fs::read_to_string(&self.faults).is_ok_and(|now| now == text) {
            return;
        }
        let before = self.d().log().matches(APPLIED).count();
        // Renamed into place, so the daemon never reads half a file.
        let tmp = self.faults.with_extension("new");
        std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("{}: {e}", tmp.display()));
        std::fs::rename(&tmp, &self.faults).unwrap_or_else(|e| panic!("{}: {e}", self.faults.display()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.d().log().matches(APPLIED).count() == before {
            assert!(Instant::now() < deadline, "the daemon did not take the faults {text:?}\n{}", self.d().log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
