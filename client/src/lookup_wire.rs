//! LOOKUP on the client's side ([`kvproto::lookup_wire`]): lookups over Unix-socket connections
//! of their own, framed without HTTP/2, when the daemon serves them; gRPC otherwise.
//!
//! A lookup is on the path of every request an engine serves: this takes HTTP/2 and tonic, and
//! the tasks they hand a call between, off both ends of it. Connections are opened on demand,
//! one per lookup in flight, and up to [`KEEP`] are kept between lookups.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvproto::lookup_wire::{self, HELLO_BYTES, MAX_ANSWER_BYTES};
use kvproto::pb;
use parking_lot::Mutex;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Connections kept open between lookups (each counts against the uid's
/// `limits.max_connections_per_uid` on the daemon).
pub const KEEP: usize = 2;
/// How long opening a connection (connect, hello, the daemon's hello) may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);

/// The LOOKUP connections of one client.
#[derive(Debug)]
pub(crate) struct LookupConns {
    socket: PathBuf,
    kept: Mutex<Vec<UnixStream>>,
    /// Whether the client may use LOOKUP at all ([`crate::Client::set_lookup_wire`]).
    wanted: AtomicBool,
    /// The daemon did not answer the hello: it does not serve LOOKUP (asked again after a
    /// reconnect, which may reach another daemon).
    unserved: AtomicBool,
}

/// Why an exchange failed.
enum Broken {
    /// The connection failed or closed: a kept one may simply be stale.
    Io(std::io::Error),
    /// The daemon answered something that is not LOOKUP.
    Garbled(String),
}

impl LookupConns {
    pub fn new(socket: PathBuf) -> Self {
        Self { socket, kept: Mutex::new(Vec::new()), wanted: AtomicBool::new(true), unserved: AtomicBool::new(false) }
    }

    pub fn set_wanted(&self, on: bool) {
        self.wanted.store(on, Ordering::Relaxed);
        if !on {
            self.kept.lock().clear();
        }
    }

    /// Forgets the kept connections and whether the daemon serves LOOKUP: after a reconnect,
    /// the daemon may be another one.
    pub fn reset(&self) {
        self.kept.lock().clear();
        self.unserved.store(false, Ordering::Relaxed);
    }

    /// `req` over LOOKUP: None when LOOKUP is not to be used (off, or the daemon does not serve
    /// it), and the caller asks over gRPC. A failure to reach the daemon is UNAVAILABLE, as
    /// gRPC's would be, so that the caller reconnects.
    pub async fn lookup(&self, req: &pb::LookupRequest) -> Option<Result<pb::LookupResponse, tonic::Status>> {
        if !self.wanted.load(Ordering::Relaxed) || self.unserved.load(Ordering::Relaxed) {
            return None;
        }
        let frame = lookup_wire::request(&req.encode_to_vec());
        // A kept connection may have been closed by the daemon since (its idle limit, a
        // restart): one that fails is dropped and the lookup goes on the next, or a new one.
        loop {
            let kept = self.kept.lock().pop();
            let reused = kept.is_some();
            let mut conn = match kept {
                Some(c) => c,
                None => match self.open().await {
                    Ok(Some(c)) => c,
                    Ok(None) => {
                        tracing::info!(
                            "kvcached did not take a LOOKUP connection (engines.lookup_wire off, an older daemon, or a connection limit); lookups go over gRPC until the client reconnects"
                        );
                        self.unserved.store(true, Ordering::Relaxed);
                        return None;
                    }
                    Err(e) => return Some(Err(tonic::Status::unavailable(format!("LOOKUP connection: {e}")))),
                },
            };
            match exchange(&mut conn, &frame).await {
                Ok(r) => {
                    let mut kept = self.kept.lock();
                    if kept.len() < KEEP {
                        kept.push(conn);
                    }
                    return Some(r);
                }
                Err(Broken::Io(_)) if reused => continue,
                Err(Broken::Io(e)) => return Some(Err(tonic::Status::unavailable(format!("LOOKUP: {e}")))),
                Err(Broken::Garbled(why)) => return Some(Err(tonic::Status::internal(format!("LOOKUP: {why}")))),
            }
        }
    }

    /// A new connection whose hello the daemon answered; None when it answered otherwise (it
    /// does not serve LOOKUP).
    async fn open(&self) -> std::io::Result<Option<UnixStream>> {
        let opened = tokio::time::timeout(OPEN_TIMEOUT, async {
            let mut s = UnixStream::connect(&self.socket).await?;
            s.write_all(&lookup_wire::hello()).await?;
            let mut hello = [0u8; HELLO_BYTES];
            match s.read_exact(&mut hello).await {
                Ok(_) if lookup_wire::check_hello(&hello).is_ok() => Ok(Some(s)),
                Ok(_) => Ok(None),
                // Closed without a hello: HTTP/2 refused the bytes.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await;
        opened.unwrap_or(Ok(None))
    }
}

/// One request and its answer.
async fn exchange(conn: &mut UnixStream, frame: &[u8]) -> Result<Result<pb::LookupResponse, tonic::Status>, Broken> {
    conn.write_all(frame).await.map_err(Broken::Io)?;
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).await.map_err(Broken::Io)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_ANSWER_BYTES {
        return Err(Broken::Garbled(format!("an answer of {n} bytes")));
    }
    let mut body = vec![0u8; n];
    conn.read_exact(&mut body).await.map_err(Broken::Io)?;
    match lookup_wire::parse_answer(&body).map_err(Broken::Garbled)? {
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
