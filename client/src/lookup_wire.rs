//! LOOKUP on the client's side ([`kvproto::lookup_wire`]): lookups over Unix-socket connections
//! of their own, framed without HTTP/2, when the daemon serves them; gRPC otherwise.
//!
//! A lookup is on the path of every request an engine serves: this takes HTTP/2 and tonic, and
//! the tasks they hand a call between, off both ends of it. Connections are opened on demand,
//! one per lookup in flight up to [`MAX_OPEN`] (further lookups at once go over gRPC), and
//! [`KEEP`] of each kind (async, blocking) stay open between lookups; every one counts against the uid's
//! `limits.max_connections_per_uid` on the daemon.
//!
//! A caller on a thread of its own (the blocking client, the Python package) can look up with
//! blocking I/O on that thread ([`LookupConns::lookup_blocking`], connections kept apart): the
//! daemon's answer wakes the caller itself, not a runtime's worker that then wakes the caller.
//! Between the two vCPUs of the machine the figures were measured on, each such wake-up costs
//! about 25 us (docs/benchmarks.md, "A lookup against the raw socket").

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvproto::lookup_wire::{self, HELLO_BYTES, MAX_ANSWER_BYTES};
use kvproto::pb;
use parking_lot::Mutex;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Connections of each kind (async, blocking) kept open between lookups.
pub const KEEP: usize = 2;
/// LOOKUP connections in use at once.
pub const MAX_OPEN: usize = 4;
/// Requests larger than this go over gRPC (a prompt inline whose token area is off): the daemon
/// may refuse one by its length and close the connection before reading it, and a request that
/// does not fit the socket's buffer would then fail to send instead of reading that refusal.
pub const MAX_REQUEST_BYTES: usize = 64 << 10;
/// How long opening a connection (connect, hello, the daemon's hello) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long lookups go over gRPC after a LOOKUP connection could not be opened for a reason that
/// may pass (the daemon away or busy, a connection limit).
const PAUSE: Duration = Duration::from_secs(1);
/// How long a blocking lookup waits for its answer (the daemon answers or closes within its
/// `limits.request_timeout_ms`; this only bounds a daemon that stopped answering at all).
const BLOCKING_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

const UNKNOWN: u8 = 0;
const SERVED: u8 = 1;
const UNSERVED: u8 = 2;

/// The LOOKUP connections of one client.
#[derive(Debug)]
pub(crate) struct LookupConns {
    kept: Mutex<Vec<UnixStream>>,
    /// Connections kept for [`LookupConns::lookup_blocking`] (blocking sockets).
    kept_blocking: Mutex<Vec<std::os::unix::net::UnixStream>>,
    /// Connections in use now.
    open: AtomicUsize,
    /// Whether the client may use LOOKUP at all ([`crate::Client::set_lookup_wire`]).
    wanted: AtomicBool,
    /// Whether the daemon answered a hello: [`SERVED`], [`UNSERVED`] (it answered something
    /// else: it does not serve LOOKUP; asked again after a reconnect), or not known yet.
    served: AtomicU8,
    /// Until when lookups go over gRPC after a failure to open that may pass.
    paused_until: Mutex<Option<Instant>>,
}

/// Why an exchange failed.
enum Broken {
    /// The connection failed or closed: a kept one may simply be stale.
    Io(std::io::Error),
    /// The daemon answered something that is not LOOKUP.
    Garbled(String),
}

/// Why no connection was opened.
enum Unopened {
    /// The daemon answered the hello with something else: it does not serve LOOKUP.
    Unserved,
    /// Refused, closed, reset or silent: the daemon may be away, restarting or at a connection
    /// limit. The lookup goes over gRPC, whose failure, if any, decides about reconnecting.
    Passing(String),
}

/// A connection in use, counted in [`LookupConns::open`] until dropped.
struct InUse<'a>(&'a AtomicUsize);

impl Drop for InUse<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LookupConns {
    pub fn new() -> Self {
        Self {
            kept: Mutex::new(Vec::new()),
            kept_blocking: Mutex::new(Vec::new()),
            open: AtomicUsize::new(0),
            wanted: AtomicBool::new(true),
            served: AtomicU8::new(UNKNOWN),
            paused_until: Mutex::new(None),
        }
    }

    pub fn set_wanted(&self, on: bool) {
        self.wanted.store(on, Ordering::Relaxed);
        if !on {
            self.kept.lock().clear();
            self.kept_blocking.lock().clear();
        }
    }

    /// Whether the daemon serves LOOKUP: None until a lookup has asked.
    pub fn served(&self) -> Option<bool> {
        match self.served.load(Ordering::Relaxed) {
            SERVED => Some(true),
            UNSERVED => Some(false),
            _ => None,
        }
    }

    /// Forgets the kept connections and whether the daemon serves LOOKUP: after a reconnect,
    /// the daemon may be another one.
    pub fn reset(&self) {
        self.kept.lock().clear();
        self.kept_blocking.lock().clear();
        self.served.store(UNKNOWN, Ordering::Relaxed);
        *self.paused_until.lock() = None;
    }

    /// `req` over LOOKUP to the daemon at `socket`: None when LOOKUP is not to be used (off, not served, paused, too many
    /// in use, a request too large) or failed, and the caller asks over gRPC: a daemon that went
    /// away is then told by gRPC's UNAVAILABLE, as for any other call.
    pub async fn lookup(
        &self,
        socket: &Path,
        req: &pb::LookupRequest,
    ) -> Option<Result<pb::LookupResponse, tonic::Status>> {
        let (frame, _in_use) = self.admit(req)?;
        // A kept connection may have been closed by the daemon since (its idle limit, a
        // restart): one that fails is dropped and the lookup goes on the next, or a new one.
        loop {
            let kept = self.kept.lock().pop();
            let reused = kept.is_some();
            let mut conn = match kept {
                Some(c) => c,
                None => match self.open(socket).await {
                    Ok(c) => c,
                    Err(why) => return self.unopened(why),
                },
            };
            let r = exchange(&mut conn, &frame).await;
            if let Some(end) = self.after(&self.kept, conn, reused, r) {
                return end;
            }
        }
    }

    /// [`LookupConns::lookup`] with blocking I/O on the calling thread, which must not be a
    /// runtime's worker: the same rules, limits and fallbacks, on connections of its own.
    pub fn lookup_blocking(
        &self,
        socket: &Path,
        req: &pb::LookupRequest,
    ) -> Option<Result<pb::LookupResponse, tonic::Status>> {
        let (frame, _in_use) = self.admit(req)?;
        loop {
            let kept = self.kept_blocking.lock().pop();
            let reused = kept.is_some();
            let mut conn = match kept {
                Some(c) => c,
                None => match self.open_blocking(socket) {
                    Ok(c) => c,
                    Err(why) => return self.unopened(why),
                },
            };
            let r = exchange_blocking(&mut conn, &frame);
            if let Some(end) = self.after(&self.kept_blocking, conn, reused, r) {
                return end;
            }
        }
    }

    /// What one exchange on `conn` comes to: `None` to go on with the next connection (a kept
    /// one failed: the daemon may have closed it since, at its idle limit or a restart),
    /// otherwise the lookup's end. A connection that answered goes back to `kept`.
    fn after<C>(
        &self,
        kept: &Mutex<Vec<C>>,
        conn: C,
        reused: bool,
        r: Result<Result<pb::LookupResponse, tonic::Status>, Broken>,
    ) -> Option<Option<Result<pb::LookupResponse, tonic::Status>>> {
        match r {
            Ok(r) => {
                let mut kept = kept.lock();
                if kept.len() < KEEP {
                    kept.push(conn);
                }
                Some(Some(r))
            }
            Err(Broken::Io(_)) if reused => None,
            Err(Broken::Io(e)) => Some(self.unopened(Unopened::Passing(e.to_string()))),
            Err(Broken::Garbled(why)) => Some(Some(Err(tonic::Status::internal(format!("LOOKUP: {why}"))))),
        }
    }

    /// Whether `req` may go over LOOKUP now, and its frame: `None` when it is to go over gRPC
    /// (off, not served, paused, too large, too many in use).
    fn admit(&self, req: &pb::LookupRequest) -> Option<(Vec<u8>, InUse<'_>)> {
        if !self.wanted.load(Ordering::Relaxed)
            || self.served.load(Ordering::Relaxed) == UNSERVED
            || self.paused_until.lock().is_some_and(|t| Instant::now() < t)
        {
            return None;
        }
        let len = req.encoded_len();
        if len > MAX_REQUEST_BYTES {
            return None;
        }
        if self.open.fetch_add(1, Ordering::Relaxed) >= MAX_OPEN {
            self.open.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let in_use = InUse(&self.open);
        let mut frame = lookup_wire::request_frame(len);
        req.encode_raw(&mut frame);
        Some((frame, in_use))
    }

    /// [`LookupConns::open`] with blocking I/O.
    fn open_blocking(&self, socket: &Path) -> Result<std::os::unix::net::UnixStream, Unopened> {
        use std::io::{Read, Write};
        let passing = |e: std::io::Error| Unopened::Passing(e.to_string());
        let mut s = std::os::unix::net::UnixStream::connect(socket).map_err(passing)?;
        s.set_read_timeout(Some(OPEN_TIMEOUT)).map_err(passing)?;
        s.set_write_timeout(Some(OPEN_TIMEOUT)).map_err(passing)?;
        s.write_all(&lookup_wire::hello()).map_err(passing)?;
        let mut hello = [0u8; HELLO_BYTES];
        match s.read_exact(&mut hello) {
            Ok(()) if lookup_wire::check_hello(&hello).is_ok() => {}
            Ok(()) => return Err(Unopened::Unserved),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(Unopened::Passing("no hello within 2 s".into()));
            }
            Err(e) => return Err(passing(e)),
        }
        self.served.store(SERVED, Ordering::Relaxed);
        s.set_read_timeout(Some(BLOCKING_ANSWER_TIMEOUT)).map_err(passing)?;
        s.set_write_timeout(Some(BLOCKING_ANSWER_TIMEOUT)).map_err(passing)?;
        Ok(s)
    }

    /// What a lookup does when no connection could be opened, or a new one failed.
    fn unopened(&self, why: Unopened) -> Option<Result<pb::LookupResponse, tonic::Status>> {
        match why {
            Unopened::Unserved => {
                if self.served.swap(UNSERVED, Ordering::Relaxed) != UNSERVED {
                    tracing::info!(
                        "kvcached does not serve LOOKUP (engines.lookup_wire off, or an older daemon); lookups go over gRPC"
                    );
                }
                None
            }
            Unopened::Passing(why) => {
                tracing::debug!("LOOKUP failed ({why}); lookups go over gRPC for {PAUSE:?}");
                *self.paused_until.lock() = Some(Instant::now() + PAUSE);
                None
            }
        }
    }

    /// A new connection whose hello the daemon answered.
    async fn open(&self, socket: &Path) -> Result<UnixStream, Unopened> {
        let mut s = match tokio::time::timeout(OPEN_TIMEOUT, UnixStream::connect(socket)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(Unopened::Passing(e.to_string())),
            Err(_) => return Err(Unopened::Passing("connect timed out".into())),
        };
        let greeted = tokio::time::timeout(OPEN_TIMEOUT, async {
            s.write_all(&lookup_wire::hello()).await?;
            let mut hello = [0u8; HELLO_BYTES];
            s.read_exact(&mut hello).await.map(|_| hello)
        })
        .await;
        match greeted {
            Ok(Ok(hello)) if lookup_wire::check_hello(&hello).is_ok() => {
                self.served.store(SERVED, Ordering::Relaxed);
                Ok(s)
            }
            // HTTP/2 (a daemon that does not serve LOOKUP) sends its SETTINGS first.
            Ok(Ok(_)) => Err(Unopened::Unserved),
            Ok(Err(e)) => Err(Unopened::Passing(e.to_string())),
            Err(_) => Err(Unopened::Passing("no hello within 2 s".into())),
        }
    }
}

/// One request and its answer.
async fn exchange(conn: &mut UnixStream, frame: &[u8]) -> Result<Result<pb::LookupResponse, tonic::Status>, Broken> {
    conn.write_all(frame).await.map_err(Broken::Io)?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).await.map_err(Broken::Io)?;
    let mut body = vec![0u8; answer_len(len)?];
    conn.read_exact(&mut body).await.map_err(Broken::Io)?;
    answer_of(&body)
}

/// [`exchange`] with blocking I/O.
fn exchange_blocking(
    conn: &mut std::os::unix::net::UnixStream,
    frame: &[u8],
) -> Result<Result<pb::LookupResponse, tonic::Status>, Broken> {
    use std::io::{Read, Write};
    conn.write_all(frame).map_err(Broken::Io)?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).map_err(Broken::Io)?;
    let mut body = vec![0u8; answer_len(len)?];
    conn.read_exact(&mut body).map_err(Broken::Io)?;
    answer_of(&body)
}

/// The length an answer frame announces, refused past [`MAX_ANSWER_BYTES`].
fn answer_len(len: [u8; 4]) -> Result<usize, Broken> {
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_ANSWER_BYTES {
        return Err(Broken::Garbled(format!("an answer of {n} bytes")));
    }
    Ok(n)
}

/// The answer in an answer frame's body.
fn answer_of(body: &[u8]) -> Result<Result<pb::LookupResponse, tonic::Status>, Broken> {
    match lookup_wire::parse_answer(body).map_err(Broken::Garbled)? {
        Ok(message) => pb::LookupResponse::decode(message)
            .map(Ok)
            .map_err(|e| Broken::Garbled(format!("an answer that does not decode: {e}"))),
        Err(r) => Ok(Err(status_of(r))),
    }
}

/// A refusal as the gRPC status the same lookup over gRPC would have got.
fn status_of(r: lookup_wire::Refusal) -> tonic::Status {
    let mut s = tonic::Status::new(tonic::Code::from_i32(r.code), r.message);
    if let Ok(v) = r.reason.parse()
        && !r.reason.is_empty()
    {
        s.metadata_mut().insert(kvproto::reason::METADATA_KEY, v);
    }
    s
}
