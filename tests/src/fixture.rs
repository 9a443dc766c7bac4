//! Small fixtures the integration tests share: the two-layer KV layout most of them use, their
//! prompts, engines' KV memory filled and checked, workers attached, and child processes that do
//! not outlive a test.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::{Dtype, KvLayout, LayoutKind, Namespace};

/// 2 layers x 2 KV heads x 64 dims, bf16, 16 tokens a block, layer-separate: 16 KiB blocks.
pub fn small_layout() -> KvLayout {
    KvLayout {
        num_layers: 2,
        kv_heads: 2,
        head_dim: 64,
        dtype: Dtype::Bf16,
        tokens_per_block: 16,
        kind: LayoutKind::LayerSeparate,
    }
}

/// Model `model` in [`small_layout`].
pub fn small_namespace(model: &str) -> Namespace {
    Namespace::new(model, small_layout())
}

/// Bytes of one block of [`small_layout`].
pub fn small_block_len() -> usize {
    small_layout().block_bytes() as usize
}

/// Prompt `seed`'s first `blocks` blocks of 16 tokens (seed 0: the prompt of the tests that
/// need only one).
pub fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000).collect()
}

/// Writes blocks `0..blocks` of prompt `seed`'s synthetic KV ([`synthetic_block`]) into slots
/// `first_slot..` of `mem`.
pub fn fill(mem: &mut KvMemory, seed: u64, blocks: u32, first_slot: u32) {
    let len = mem.block_ranges(0).iter().map(|r| r.len()).sum();
    for b in 0..blocks {
        mem.write_block(first_slot + b, &synthetic_block(seed, b, len));
    }
}

/// Anonymous KV memory of `slots` slots of `layout`, the first `filled` holding prompt `seed`'s
/// synthetic KV ([`fill`]).
pub fn filled_memory(layout: &KvLayout, slots: u32, seed: u64, filled: u32) -> KvMemory {
    let mut mem = KvMemory::anonymous(layout, slots).unwrap_or_else(|e| panic!("KV memory: {e}"));
    fill(&mut mem, seed, filled, 0);
    mem
}

/// Asserts that slots `first_slot..` of `mem` hold blocks `0..blocks` of prompt `seed`'s
/// synthetic KV, byte for byte.
pub fn check(mem: &KvMemory, seed: u64, blocks: u32, first_slot: u32) {
    let len = mem.block_ranges(0).iter().map(|r| r.len()).sum();
    for b in 0..blocks {
        assert_eq!(mem.read_block(first_slot + b), synthetic_block(seed, b, len), "block {b} differs");
    }
}

/// An engine on the daemon at `socket`, registered as worker `name` of a cluster router
/// (`address`, `role`: `prefill`, `decode`, `both`) with `mem` in namespace `ns`.
pub async fn worker(socket: &Path, name: &str, ns: &Namespace, mem: &KvMemory, address: &str, role: &str) -> Client {
    let c = Client::connect(socket).await.unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    c.register_worker(name, ns, mem, address, role).await.unwrap_or_else(|e| panic!("register {name}: {e}"));
    c
}

/// An engine named `e` on the daemon at `socket`, registered with `mem` in namespace `ns` (no
/// router address or role).
pub async fn attach(socket: &Path, ns: &Namespace, mem: &KvMemory) -> Client {
    worker(socket, "e", ns, mem, "", "").await
}

/// A child process (a daemon, a router, a Prometheus), killed and waited for when dropped, so
/// that none outlives a test that fails before stopping it.
#[derive(Debug)]
pub struct KillOnDrop(pub Option<Child>);

impl KillOnDrop {
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// Spawns `cmd` (a daemon) and waits, 30 s at most, until it accepts connections on `socket`.
    /// A daemon that exits, or does not start in time, fails the test with the tail of
    /// `kvcached.stderr` beside the socket, where [`daemon_stderr`] sends its standard error.
    pub fn spawn_serving(cmd: &mut Command, socket: &Path) -> Self {
        let log = socket.with_file_name("kvcached.stderr");
        let mut daemon = Self::new(cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}")));
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            let exited = daemon.0.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: String =
                    text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
                let what = exited.map_or("did not start in 30 s".to_string(), |s| format!("exited with {s}"));
                panic!("the daemon on {} {what}; its stderr ends:\n{tail}", socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    /// Sends `sig` to the child and hands it over (to be waited for), unless it was taken.
    pub fn signal(&mut self, sig: i32) -> Option<Child> {
        let child = self.0.take()?;
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        Some(child)
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `kvcached` binary `bin` (the tests' `daemon`) for a node in `dir`: its socket
/// `dir/kvcached.sock`, a 64 MiB G2 pool in `dir`, a 128 MiB G3 in `dir/g3` without fdatasync,
/// engine leases of 2 s; its stdout to nowhere.
pub fn daemon_command(bin: &str, dir: &Path) -> Command {
    let path = |p: &Path| p.to_str().unwrap_or_else(|| panic!("{}", p.display())).to_string();
    let mut c = Command::new(bin);
    c.args(["--socket", &path(&dir.join("kvcached.sock"))])
        .args(["--g2-capacity-bytes", "67108864", "--g2-shm-dir", &path(dir)])
        .args(["--g3-dir", &path(&dir.join("g3")), "--g3-capacity-bytes", "134217728"])
        .args(["--g3-fsync", "false", "--engine-lease-ms", "2000"])
        .stdout(Stdio::null());
    c
}

/// Sends `cmd`'s standard error to `kvcached.stderr` in `dir` (appended to across restarts),
/// where [`KillOnDrop::spawn_serving`] reads it back if the daemon does not start.
pub fn daemon_stderr(cmd: &mut Command, dir: &Path) {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("kvcached.stderr"));
    cmd.stderr(file.map_or(Stdio::null(), Stdio::from));
}

/// `argv` of a `kvbench` command (`replay`, `soak`) followed by what every such run in the
/// tests names: the daemon and router binaries `daemon` and `router` (this package's), the run's
/// directory `dir`, where its reports go `out`.
pub fn kvbench_argv(argv: &[&str], daemon: &str, router: &str, dir: &Path, out: &Path) -> Vec<std::ffi::OsString> {
    let mut all: Vec<std::ffi::OsString> = argv.iter().map(Into::into).collect();
    for (flag, value) in
        [("--kvcached", Path::new(daemon)), ("--kvrouter", Path::new(router)), ("--dir", dir), ("--out", out)]
    {
        all.extend([flag.into(), value.into()]);
    }
    all
}
