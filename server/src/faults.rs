//! Fault injection for the fault suites (`tests/faults.rs`), never for production: with
//! `inject_faults = "<file>"` the store's G3 engines and G4 client are opened through the
//! decorators of `kvtiers` ([`kvtiers::disk::faults`], [`kvtiers::object::faults`]), and thread
//! `kv-faults` reads the file again whenever it changes, so a test switches faults on and off
//! while the daemon runs. Unset (the default), nothing is wrapped and no thread starts.
//!
//! The file (TOML; a missing file or an empty one injects nothing, one that does not parse
//! clears every fault and is logged):
//!
//! ```toml
//! [g3]
//! read_eio = 1.0      # fraction of read ops that fail with EIO
//! write_eio = 0.0     # ... write ops that fail with EIO
//! enospc = 0.0        # ... write ops that fail with ENOSPC
//! torn_write = 0.0    # ... write ops of which only the first half is written, reported whole
//! short_write = 0.0   # ... write ops of which the first half is written, then fail
//! latency_ms = 0      # added to a fraction `latency` of batches
//! latency = 1.0
//! [g4]
//! down = false        # every request fails
//! latency_ms = 0      # added to every request
//! [g1]
//! fail_every = 0      # every n-th copy submission between an engine's GPU memory and G2
//!                     # fails, torn half way (`kvtiers::copy::faults`); GPU engines and
//!                     # emulated ones
//! emulate = false     # engines registered from now on with shared memory are served as a
//!                     # GPU's: every copy queued on a fake device's lanes (worker threads),
//!                     # as the daemon queues CUDA copies on streams (`kvtiers::copy::fake`)
//! delay_us = 0        # each emulated submission's copies start this late (holds many in
//!                     # flight)
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kvtiers::copy::fake::FakeFaults;
use kvtiers::copy::faults::CopyFaults;
use kvtiers::disk::faults::{DiskFaultSpec, DiskFaults};
use kvtiers::object::faults::Faults as ObjectFaults;
use serde::Deserialize;

/// How often the file is looked at.
const POLL: Duration = Duration::from_millis(50);

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
struct FaultFile {
    g3: G3Faults,
    g4: G4Faults,
    g1: G1File,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
struct G1File {
    emulate: bool,
    fail_every: u64,
    delay_us: u64,
}

/// The G1 switches: failures of every device engine's copies; whether engines registered now
/// get an emulated device over their shared memory, and its delay (shared by every engine).
#[derive(Debug, Default)]
pub struct G1Faults {
    pub copies: Arc<CopyFaults>,
    pub emulate: AtomicBool,
    pub device: Arc<FakeFaults>,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
struct G3Faults {
    read_eio: f64,
    write_eio: f64,
    enospc: f64,
    torn_write: f64,
    short_write: f64,
    latency: f64,
    latency_ms: u64,
}

#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
struct G4Faults {
    down: bool,
    latency_ms: u64,
}

impl FaultFile {
    /// The faults `text` names; a text that does not parse names none (and says why).
    fn parse(text: &str) -> (Self, Option<String>) {
        match toml::from_str::<Self>(text) {
            Ok(f) => (f, None),
            Err(e) => (Self::default(), Some(e.to_string())),
        }
    }

    /// Sets the switches of the tiers still open (None: the tier is off, or gone).
    fn apply(&self, g3: Option<&DiskFaults>, g4: Option<&ObjectFaults>, g1: Option<&G1Faults>) {
        if let Some(g1) = g1 {
            g1.emulate.store(self.g1.emulate, Ordering::Relaxed);
            g1.copies.fail_every(self.g1.fail_every);
            g1.device.set_delay(Duration::from_micros(self.g1.delay_us));
        }
        let f = &self.g3;
        if let Some(g3) = g3 {
            g3.set(&DiskFaultSpec {
                read_eio: f.read_eio,
                write_eio: f.write_eio,
                enospc: f.enospc,
                torn_write: f.torn_write,
                short_write: f.short_write,
                latency: f.latency,
                latency_ms: f.latency_ms,
            });
        }
        if let Some(g4) = g4 {
            g4.down.store(self.g4.down, Ordering::Relaxed);
            g4.latency_ms.store(self.g4.latency_ms, Ordering::Relaxed);
        }
    }
}

/// Opens the store's lower tiers through the fault decorators and starts thread `kv-faults`
/// applying `path`'s faults. Returns the G1 switches, for the engine registry. The thread ends
/// once the store and the registry (the only other holders of the switches) are gone.
pub fn install(path: &Path, cfg: &mut kvtiers::BlockStoreConfig) -> Arc<G1Faults> {
    tracing::warn!(file = %path.display(), "fault injection is on (inject_faults): for tests only");
    let g3 = Arc::new(DiskFaults::default());
    let g4 = Arc::new(ObjectFaults::default());
    if let Some(c) = cfg.g3.as_mut() {
        c.faults = Some(Arc::clone(&g3));
    }
    if let Some(c) = cfg.g4.as_mut() {
        c.faults = Some(Arc::clone(&g4));
    }
    // Applied once now, so the faults are in place before the first request.
    let mut seen = std::fs::read_to_string(path).unwrap_or_default();
    let (first, err) = FaultFile::parse(&seen);
    if let Some(e) = err {
        tracing::warn!("{}: {e}; no faults injected", path.display());
    }
    let g1 = Arc::new(G1Faults::default());
    first.apply(Some(&g3), Some(&g4), Some(&g1));
    let (w3, w4, w1) = (Arc::downgrade(&g3), Arc::downgrade(&g4), Arc::downgrade(&g1));
    // Held by the tiers configured; a tier that is off drops its switches with this function.
    let path = path.to_path_buf();
    let spawned =
        std::thread::Builder::new().name("kv-faults".into()).spawn(move || watch(&path, &mut seen, &w3, &w4, &w1));
    if let Err(e) = spawned {
        tracing::warn!("cannot start thread kv-faults ({e}): the faults stay as the file named them at start");
    }
    g1
}

fn watch(path: &PathBuf, seen: &mut String, g3: &Weak<DiskFaults>, g4: &Weak<ObjectFaults>, g1: &Weak<G1Faults>) {
    loop {
        std::thread::sleep(POLL);
        let (g3, g4, g1) = (g3.upgrade(), g4.upgrade(), g1.upgrade());
        if g3.is_none() && g4.is_none() && g1.is_none() {
            return;
        }
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text == *seen {
            continue;
        }
        let (faults, err) = FaultFile::parse(&text);
        match err {
            Some(e) => tracing::warn!("{}: {e}; no faults injected", path.display()),
            None => tracing::info!(?faults, "injected faults changed"),
        }
        faults.apply(g3.as_deref(), g4.as_deref(), g1.as_deref());
        *seen = text;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_file_names_faults_and_garbage_names_none() {
        let (f, err) = FaultFile::parse(
            "[g3]\nread_eio = 0.5\nlatency_ms = 20\n[g4]\ndown = true\n[g1]\nemulate = true\nfail_every = 3\n",
        );
        assert_eq!(err, None);
        assert_eq!((f.g3.read_eio, f.g3.latency_ms, f.g4.down), (0.5, 20, true));
        assert_eq!((f.g1.emulate, f.g1.fail_every, f.g1.delay_us), (true, 3, 0));
        let (f, err) = FaultFile::parse("[g3]\nread_eoi = 1.0\n");
        assert!(err.unwrap().contains("read_eoi"));
        assert_eq!(f, FaultFile::default());
        assert_eq!(FaultFile::parse(""), (FaultFile::default(), None));
    }
}
