//! A value built from files and rebuilt when one of them changes (certificates, keys, token
//! lists): operators rotate them without a restart. Files are looked at no more than once a
//! second; a rebuild that fails keeps the last good value and logs why, so a half-written file
//! never takes an endpoint down.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use crate::error::NetError;

/// How often the files' modification times are looked at.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The first of `paths` (the one file of a [`Reloading::file`]) and its text; an error names
/// the file as `what`.
pub(crate) fn read_first(what: &'static str, paths: &[PathBuf]) -> Result<(PathBuf, String), NetError> {
    let path = paths.first().ok_or_else(|| NetError::Config(format!("no {what} named")))?;
    let text =
        std::fs::read_to_string(path).map_err(|e| NetError::File { what, path: path.clone(), why: e.to_string() })?;
    Ok((path.clone(), text))
}

/// How [`Reloading::tls`] builds a TLS configuration: from the files, offering the protocols.
type BuildTls<T> = fn(&[PathBuf], &[&[u8]]) -> Result<T, NetError>;

type Build<T> = dyn Fn(&[PathBuf]) -> Result<T, NetError> + Send + Sync;

struct State<T> {
    checked: Instant,
    stamps: Vec<Option<SystemTime>>,
    value: Arc<T>,
}

/// The current value built from `paths`.
pub struct Reloading<T> {
    what: &'static str,
    paths: Vec<PathBuf>,
    build: Box<Build<T>>,
    state: Mutex<State<T>>,
}

impl<T> std::fmt::Debug for Reloading<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading").field("what", &self.what).field("paths", &self.paths).finish()
    }
}

fn stamps(paths: &[PathBuf]) -> Vec<Option<SystemTime>> {
    paths.iter().map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect()
}

impl<T> Reloading<T> {
    /// Builds the first value now: an error here is a start-up error.
    pub fn new(
        what: &'static str,
        paths: Vec<PathBuf>,
        build: impl Fn(&[PathBuf]) -> Result<T, NetError> + Send + Sync + 'static,
    ) -> Result<Self, NetError> {
        let value = Arc::new(build(&paths)?);
        let state = Mutex::new(State { checked: Instant::now(), stamps: stamps(&paths), value });
        Ok(Self { what, paths, build: Box::new(build), state })
    }

    /// A TLS configuration that `build` makes from `paths`, offering the protocols `alpn`.
    pub fn tls(what: &'static str, paths: Vec<PathBuf>, alpn: &[&[u8]], build: BuildTls<T>) -> Result<Self, NetError>
    where
        T: 'static,
    {
        let alpn: Vec<Vec<u8>> = alpn.iter().map(|a| a.to_vec()).collect();
        Self::new(what, paths, move |p| {
            let a: Vec<&[u8]> = alpn.iter().map(Vec::as_slice).collect();
            build(p, &a)
        })
    }

    /// What `load` makes of the one file `path`, when one is named.
    pub fn file(
        what: &'static str,
        path: Option<&PathBuf>,
        load: fn(&[PathBuf]) -> Result<T, NetError>,
    ) -> Result<Option<Self>, NetError>
    where
        T: 'static,
    {
        path.map(|p| Self::new(what, vec![p.clone()], load)).transpose()
    }

    /// The current value, rebuilt first if a file changed since the last look.
    pub fn get(&self) -> Arc<T> {
        let mut s = self.state.lock();
        if s.checked.elapsed() < CHECK_EVERY {
            return Arc::clone(&s.value);
        }
        s.checked = Instant::now();
        let now = stamps(&self.paths);
        if now == s.stamps {
            return Arc::clone(&s.value);
        }
        // Built under the lock: rare, and a second caller must not build it again.
        match (self.build)(&self.paths) {
            Ok(v) => {
                tracing::info!(what = self.what, files = ?self.paths, "reloaded");
                s.value = Arc::new(v);
                s.stamps = now;
            }
            Err(e) => {
                tracing::warn!(what = self.what, "a changed file does not load ({e}); keeping the previous one");
                // Looked at again next second: the file may be half-written.
            }
        }
        Arc::clone(&s.value)
    }

    /// Checks now, ignoring the once-a-second bound (tests, and a SIGHUP-style reload).
    pub fn refresh(&self) -> Arc<T> {
        self.state.lock().checked = Instant::now() - CHECK_EVERY;
        self.get()
    }
}
