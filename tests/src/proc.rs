//! A `kvcached` daemon as a process (optionally inside a network namespace), configured by a
//! TOML text, with its log, metrics and a clean stop; and plain HTTP/1.0 requests that work from
//! any thread (also one moved into a network namespace).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A daemon process.
#[derive(Debug)]
pub struct DaemonProc {
    child: Option<Child>,
    pub dir: PathBuf,
    pub socket: PathBuf,
    /// `host:port` of its HTTP (metrics) listener.
    pub http: String,
    /// The network namespace it runs in, if any.
    pub netns: Option<String>,
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A free TCP port on loopback for a process to listen on: see [`free_ports`].
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// Ports [`free_ports`] returned in this process.
static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// `n` TCP ports on loopback, free now, that no earlier call in this process returned, for
/// processes started afterwards to listen on. They come from below the kernel's ephemeral range
/// (`ip_local_port_range`): a port from `bind(0)` is taken back by any outgoing connection or
/// `bind(0)` of the machine until its process binds it, and under the full suite's load that
/// window is long and such connections many. Where the range leaves no room below it, ports
/// come from `bind(0)` (all held together, so distinct).
pub fn free_ports(n: usize) -> Vec<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if low < FIRST + 1000 {
        let held: Vec<std::net::TcpListener> = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("no free port: {e}")))
            .collect();
        return held.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.port()).collect();
    }
    let span = u32::from(low - FIRST);
    // Where in the band to start: apart for processes started together.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut at = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
    let mut out = Vec::with_capacity(n);
    for _ in 0..span {
        if out.len() == n {
            break;
        }
        at = (at + 1) % span;
        let port = FIRST + at as u16;
        if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            out.push(port);
        }
    }
    assert_eq!(out.len(), n, "no {n} free ports between {FIRST} and {low}");
    out
}

impl DaemonProc {
    /// Starts `bin` (the `daemon` test binary) with `toml` (without `metrics_addr`, which is set
    /// to `http`), a 64 MiB G2 pool under `dir`, and `env`. Waits for its socket.
    pub fn spawn(bin: &Path, dir: &Path, http: &str, toml: &str, netns: Option<&str>, env: &[(&str, &str)]) -> Self {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let cfg = dir.join("kvcached.toml");
        std::fs::write(&cfg, format!("metrics_addr = \"{http}\"\n{toml}")).unwrap_or_else(|e| panic!("{e}"));
        let socket = dir.join("kvcached.sock");
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        cmd.args(["--config", &cfg.to_string_lossy(), "--socket", &socket.to_string_lossy()])
            .args(["--g2-capacity-bytes", "67108864", "--g2-shm-dir", &dir.to_string_lossy()])
            .args(["--engine-lease-ms", "3000"])
            // The tests' peers (real daemons and fakes) listen on loopback.
            .args(["--peer-allowed-sources", "127.0.0.0/8"])
            // G3 only where the test configures it (the default directory is shared).
            .args(if toml.contains("[g3]") { &[][..] } else { &["--g3-enabled", "false"][..] })
            .env("RUST_LOG", "info,kvcached=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let d = Self {
            child: Some(child),
            dir: dir.to_path_buf(),
            socket: socket.clone(),
            http: http.to_string(),
            netns: netns.map(str::to_string),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(Instant::now() < deadline, "daemon did not start: {}", d.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    /// A GET on its HTTP listener (from its network namespace).
    pub fn get(&self, path: &str) -> (u16, String) {
        let (http, path) = (self.http.clone(), path.to_string());
        match &self.netns {
            Some(ns) => crate::netns::run_in(ns, move || http_get(&http, &path)),
            None => http_get(&http, &path),
        }
    }

    /// The sum of every sample of `series` (a prefix of metric lines) on `/metrics`.
    pub fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    }

    /// Waits until `series` reaches `at_least`.
    pub fn wait_metric(&self, series: &str, at_least: f64, within: Duration) -> f64 {
        let deadline = Instant::now() + within;
        loop {
            let v = self.metric(series);
            if v >= at_least {
                return v;
            }
            assert!(Instant::now() < deadline, "{series} = {v}, waited for {at_least}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, now.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait; panics unless it exits cleanly.
    pub fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap_or_else(|e| panic!("{e}"));
            assert!(status.success(), "daemon exited with {status}: {}", self.log());
        }
    }
}

/// `GET path` on `host:port` over HTTP/1.0: (status, body). Status 0 when nothing answers.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_request(addr, "GET", path, None, &[])
}

/// One HTTP/1.0 request with an optional JSON body and extra headers.
pub fn http_request(
    addr: &str,
    method: &str,
    path: &str,
    json: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    if let Some(b) = json {
        req += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len());
    } else {
        req += "\r\n";
    }
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new());
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}
