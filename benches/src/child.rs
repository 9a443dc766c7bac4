//! A child process of a bench run (a daemon, a router) writing to its own log: stopped with
//! SIGTERM and checked for a clean exit, or killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running child; killed if dropped without [`Managed::stop`].
#[derive(Debug)]
pub struct Managed {
    child: Option<Child>,
    pub name: String,
    pub pid: u32,
    pub log: PathBuf,
}

impl Managed {
    /// Starts `cmd` with stdin closed and stdout and stderr into `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: PathBuf) -> Result<Self, String> {
        let f = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(f.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(f))
            .spawn()
            .map_err(|e| format!("starting {name}: {e}"))?;
        Ok(Self { pid: child.id(), child: Some(child), name: name.to_string(), log })
    }

    /// `None` while it runs; its exit status once it exited.
    pub fn exited(&mut self) -> Option<String> {
        let c = self.child.as_mut()?;
        match c.try_wait() {
            Ok(Some(s)) => Some(s.to_string()),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    /// SIGTERM, then waits up to `within`; an error unless it exits with status 0.
    pub fn stop(mut self, within: Duration) -> Result<(), String> {
        let Some(mut c) = self.child.take() else { return Ok(()) };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + within;
        loop {
            match c.try_wait() {
                Ok(Some(s)) if s.success() => return Ok(()),
                Ok(Some(s)) => return Err(format!("{} exited with {s}: {}", self.name, tail(&self.log, 2000))),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return Err(format!("{} did not stop in {within:?} after SIGTERM: killed", self.name));
                }
            }
        }
    }
}

impl Drop for Managed {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The last `n` bytes of a log file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(n);
    // Cut on a character boundary.
    let start = (start..=s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(s.len());
    s[start..].to_string()
}

/// The router's namespace entry for the daemons a bench starts: `name` over `model`'s `layout`
/// (bf16, layer-separate, no salt), kvcached's own key scheme.
pub fn router_namespace(name: &str, model: &str, layout: &kvproto::KvLayout) -> kvrouter::NamespaceSpec {
    kvrouter::NamespaceSpec {
        name: Some(name.into()),
        model_id: model.into(),
        num_layers: layout.num_layers,
        kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        dtype: "bf16".into(),
        tokens_per_block: layout.tokens_per_block,
        layout_kind: "layer_separate".into(),
        tenant_salt_hex: None,
        adapter_id: None,
        extra_hex: None,
        key_scheme: kvproto::events::KEY_SCHEME_KVCACHED.into(),
        expected_blocks: 0,
    }
}
