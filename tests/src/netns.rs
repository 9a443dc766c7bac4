//! Two "nodes" as network namespaces joined by a veth pair, shaped with `tc`: the cross-node
//! tests run daemons in them. Addresses live only inside the namespaces; dropping the pair
//! deletes both namespaces (and with them the veth pair).

use std::process::Command;

/// Whether this machine can make network namespaces (root, `ip` present).
pub fn available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip").args(["netns", "list"]).output().is_ok_and(|o| o.status.success())
}

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Two namespaces, `a` and `b`, at `10.<net>.0.1` and `10.<net>.0.2`.
#[derive(Debug)]
pub struct NodePair {
    pub a: String,
    pub b: String,
    pub addr_a: String,
    pub addr_b: String,
    veth_a: String,
    veth_b: String,
}

impl NodePair {
    /// Makes the pair; `tag` keeps concurrent tests apart (a few characters).
    pub fn new(tag: &str) -> Self {
        let pid = std::process::id() % 100_000;
        let net = 100 + (pid % 100) as u8;
        let (a, b) = (format!("kvt{pid}{tag}a"), format!("kvt{pid}{tag}b"));
        let (veth_a, veth_b) = (format!("kv{pid}{tag}a"), format!("kv{pid}{tag}b"));
        let _ = Command::new("ip").args(["netns", "del", &a]).output();
        let _ = Command::new("ip").args(["netns", "del", &b]).output();
        run(&["ip", "netns", "add", &a]);
        run(&["ip", "netns", "add", &b]);
        let pair = Self { addr_a: format!("10.{net}.0.1"), addr_b: format!("10.{net}.0.2"), a, b, veth_a, veth_b };
        run(&["ip", "link", "add", &pair.veth_a, "type", "veth", "peer", "name", &pair.veth_b]);
        run(&["ip", "link", "set", &pair.veth_a, "netns", &pair.a]);
        run(&["ip", "link", "set", &pair.veth_b, "netns", &pair.b]);
        for (ns, dev, addr) in [(&pair.a, &pair.veth_a, &pair.addr_a), (&pair.b, &pair.veth_b, &pair.addr_b)] {
            run(&["ip", "-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            run(&["ip", "-n", ns, "link", "set", dev, "up"]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        pair
    }

    /// Shapes both directions to `mbit` Mbit/s (a token bucket; `tc qdisc replace`).
    pub fn shape(&self, mbit: u64) {
        // Burst: a millisecond at the rate (at least 64 KiB): a larger bucket lets a short
        // transfer run above the rate, a smaller one cannot sustain it.
        let burst = (mbit * 1_000_000 / 8 / 1000).max(64 << 10);
        for (ns, dev) in [(&self.a, &self.veth_a), (&self.b, &self.veth_b)] {
            run(&[
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                &format!("{mbit}mbit"),
                "burst",
                &burst.to_string(),
                "latency",
                "100ms",
            ]);
        }
    }
}

impl NodePair {
    /// What a raw TCP copy loop moves from A to B now (bytes a second): `bytes` written in
    /// 2 MiB pieces. The link a daemon can measure is at most this, whatever the shaping says.
    pub fn raw_tcp_rate(&self, bytes: usize) -> f64 {
        use std::io::{Read, Write};
        let addr_a = self.addr_a.clone();
        let listener = run_in(&self.a, move || std::net::TcpListener::bind(format!("{addr_a}:0")))
            .unwrap_or_else(|e| panic!("bind in {}: {e}", self.a));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let sender = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap_or_else(|e| panic!("accept: {e}"));
            let buf = vec![7u8; 2 << 20];
            let mut left = bytes;
            while left > 0 {
                let n = left.min(buf.len());
                s.write_all(&buf[..n]).unwrap_or_else(|e| panic!("send: {e}"));
                left -= n;
            }
        });
        let rate = run_in(&self.b, move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
            let mut buf = vec![0u8; 2 << 20];
            let (t, mut got) = (std::time::Instant::now(), 0usize);
            while got < bytes {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) => panic!("receive: {e}"),
                }
            }
            got as f64 / t.elapsed().as_secs_f64()
        });
        sender.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        rate
    }
}

impl Drop for NodePair {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.a]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.b]).output();
    }
}

/// Runs `f` on a thread moved into network namespace `ns` (sockets it makes live there).
pub fn run_in<R: Send + 'static>(ns: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a namespace file we opened; affects only this thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}
