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
//! ```

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

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
    fn apply(&self, g3: Option<&DiskFaults>, g4: Option<&ObjectFaults>) {
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
/// applying `path`'s faults. The thread ends once the store (the only other holder of the
/// switches) is gone.
pub fn install(path: &Path, cfg: &mut kvtiers::BlockStoreConfig) {
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
    first.apply(Some(&g3), Some(&g4));
    let (w3, w4) = (Arc::downgrade(&g3), Arc::downgrade(&g4));
    // Held by the tiers configured; a tier that is off drops its switches with this function.
    let path = path.to_path_buf();
    let spawned = std::thread::Builder::new().name("kv-faults".into()).spawn(move || watch(&path, &mut seen, &w3, &w4));
    if let Err(e) = spawned {
        tracing::warn!("cannot start thread kv-faults ({e}): the faults stay as the file named them at start");
    }
}

fn watch(path: &PathBuf, seen: &mut String, g3: &Weak<DiskFaults>, g4: &Weak<ObjectFaults>) {
    loop {
        std::thread::sleep(POLL);
        let (g3, g4) = (g3.upgrade(), g4.upgrade());
        if g3.is_none() && g4.is_none() {
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
        faults.apply(g3.as_deref(), g4.as_deref());
        *seen = text;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_file_names_faults_and_garbage_names_none() {
        let (f, err) = FaultFile::parse("[g3]\nread_eio = 0.5\nlatency_ms = 20\n[g4]\ndown = true\n");
        assert_eq!(err, None);
        assert_eq!((f.g3.read_eio, f.g3.latency_ms, f.g4.down), (0.5, 20, true));
        let (f, err) = FaultFile::parse("[g3]\nread_eoi = 1.0\n");
        assert!(err.unwrap().contains("read_eoi"));
        assert_eq!(f, FaultFile::default());
        assert_eq!(FaultFile::parse(""), (FaultFile::default(), None));
    }
}
