//! The records of the blocks in G3 that the vLLM-format export needs (Dynamo hash, parent hash,
//! tokens: nothing our 128-bit keys reveal), kept in a file next to G3 so that a restarted
//! daemon still exports the blocks G3 kept.
//!
//! `<g3.dir>/vllm-origins.log` is a sequence of records, each `[body length: u32 LE]
//! [XXH3-64 of the body: u64 LE][body]`, body = block key (16 bytes), hash (u64 LE), 1 if a
//! parent hash follows else 0, parent hash (u64 LE), token count (u32 LE), tokens (u32 LE each),
//! then for a block computed with a LoRA adapter its name's length (u16 LE) and UTF-8 bytes
//! (a daemon of an earlier release stops reading its log at the first such record: the blocks
//! after it are not exported after a downgrade, never exported wrongly).
//! A record is appended (thread `kv-vllm-origins`, fed by a bounded channel) when G3 takes a
//! block with a record; nothing is written when it leaves. At start the file is read up to the
//! first record that is incomplete or fails its checksum (a crash's torn tail), and rewritten
//! with only the blocks G3 still holds; it is rewritten the same way while running once it has
//! grown to four times its last rewrite, and at once after an append failed (a short write
//! would otherwise hide every later record). A clean shutdown waits for the queued records
//! ([`OriginLog::flush`]). Appends are not fsynced: a record lost in a crash is a block that is
//! not exported after the restart (counted in `kvcached_vllm_export_unknown_total`), never a
//! wrong one.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::Duration;

use kvproto::{BlockKey, TierKind};
use parking_lot::Mutex;

/// The export's record of every block it knows the origin of (key -> origin).
pub(crate) type Origins = Mutex<HashMap<BlockKey, Origin, kvproto::key::BlockKeyBuildHasher>>;

/// Where a block came from, as vLLM's events name it: its Dynamo hash, its parent's, its tokens.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    pub hash: u64,
    pub parent: Option<u64>,
    /// Shared, so that a snapshot or a log record takes it without copying.
    pub tokens: Arc<[u32]>,
    /// The LoRA adapter the block was computed with (vLLM's `lora_name`).
    pub lora: Option<Arc<str>>,
    /// Tiers holding the block (bit per `TierKind::index`).
    pub tiers: u8,
}

/// Records that may wait for the writer; more are counted and not persisted.
const QUEUE: usize = 65_536;
/// The file is rewritten once it passes this many bytes and four times its last rewrite.
const MIN_REWRITE_BYTES: u64 = 64 << 20;
/// Bytes of a record besides its tokens.
const FIXED: usize = 16 + 8 + 1 + 8 + 4;

/// One record: the block and its origin.
pub(crate) struct Record {
    pub key: BlockKey,
    pub hash: u64,
    pub parent: Option<u64>,
    pub tokens: Arc<[u32]>,
    pub lora: Option<Arc<str>>,
}

impl Record {
    fn of(key: BlockKey, o: &Origin) -> Self {
        Self { key, hash: o.hash, parent: o.parent, tokens: Arc::clone(&o.tokens), lora: o.lora.clone() }
    }
}

/// What the writer thread is sent.
enum Msg {
    Record(Record),
    /// Answer once everything sent before is written.
    Flush(SyncSender<()>),
}

fn encode(r: &Record, out: &mut Vec<u8>) {
    let mut body = Vec::with_capacity(FIXED + 4 * r.tokens.len());
    body.extend_from_slice(&r.key.0);
    body.extend_from_slice(&r.hash.to_le_bytes());
    body.push(u8::from(r.parent.is_some()));
    body.extend_from_slice(&r.parent.unwrap_or(0).to_le_bytes());
    body.extend_from_slice(&(r.tokens.len() as u32).to_le_bytes());
    for t in r.tokens.iter() {
        body.extend_from_slice(&t.to_le_bytes());
    }
    if let Some(l) = r.lora.as_deref() {
        // Adapter names are at most 1024 bytes (`kvproto::key_context::MAX_ADAPTER_NAME`).
        let l = &l.as_bytes()[..l.len().min(usize::from(u16::MAX))];
        body.extend_from_slice(&(l.len() as u16).to_le_bytes());
        body.extend_from_slice(l);
    }
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_le_bytes());
    out.extend_from_slice(&body);
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn decode_body(b: &[u8]) -> Option<Record> {
    let key = BlockKey(b.get(..16)?.try_into().ok()?);
    let hash = u64_at(b, 16)?;
    let parent = match *b.get(24)? {
        0 => None,
        1 => Some(u64_at(b, 25)?),
        _ => return None,
    };
    let n = u32_at(b, 33)? as usize;
    let end = FIXED.checked_add(n.checked_mul(4)?)?;
    let lora = match b.len().cmp(&end) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Less => return None,
        std::cmp::Ordering::Greater => {
            let len = u16::from_le_bytes(b.get(end..end + 2)?.try_into().ok()?) as usize;
            if b.len() != end + 2 + len {
                return None;
            }
            Some(Arc::from(std::str::from_utf8(&b[end + 2..]).ok()?))
        }
    };
    let tokens = b[FIXED..end].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Some(Record { key, hash, parent, tokens, lora })
}

/// The records of `data` up to the first one that is incomplete or damaged.
pub(crate) fn decode_all(data: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    let mut at = 0;
    while let (Some(len), Some(sum)) = (u32_at(data, at), u64_at(data, at + 4)) {
        let Some(body) = data.get(at + 12..at + 12 + len as usize) else { break };
        if xxhash_rust::xxh3::xxh3_64(body) != sum {
            break;
        }
        let Some(r) = decode_body(body) else { break };
        out.push(r);
        at += 12 + len as usize;
    }
    out
}

/// Reads the log at `path` (none: no records).
pub(crate) fn load(path: &Path) -> Vec<Record> {
    match std::fs::read(path) {
        Ok(data) => decode_all(&data),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), "cannot read the vLLM export's G3 records: {e}");
            Vec::new()
        }
    }
}

/// The writer of the log.
#[derive(Debug)]
pub(crate) struct OriginLog {
    tx: SyncSender<Msg>,
    unpersisted: metrics::Counter,
}

fn g3_bit() -> u8 {
    1 << TierKind::G3Disk.index()
}

/// Writes the records of every block G3 holds to `path`: into a temporary file, synced, then
/// renamed over the log, so a crash leaves the old log or the whole new one. Returns the new
/// file, open at its end for appends, and its size.
fn rewrite(path: &Path, origins: &Origins) -> std::io::Result<(File, u64)> {
    let mut data = Vec::new();
    {
        let origins = origins.lock();
        for (key, o) in origins.iter().filter(|(_, o)| o.tiers & g3_bit() != 0) {
            encode(&Record::of(*key, o), &mut data);
        }
    }
    let tmp = path.with_extension("log.tmp");
    let written = (|| {
        // 0600 whatever the umask: the records hold prompts' token ids.
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?
        };
        file.write_all(&data)?;
        file.sync_data()?;
        std::fs::rename(&tmp, path)?;
        Ok(file)
    })();
    match written {
        // The handle was opened before the rename: appends go to the new log whatever happens.
        Ok(file) => Ok((file, data.len() as u64)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

impl OriginLog {
    /// Rewrites the log at `path` with the blocks G3 holds now and starts its writer.
    pub(crate) fn start(path: PathBuf, origins: Arc<Origins>) -> std::io::Result<Self> {
        let (file, written) = rewrite(&path, &origins)?;
        let (tx, rx) = sync_channel::<Msg>(QUEUE);
        std::thread::Builder::new().name("kv-vllm-origins".into()).spawn(move || {
            write_loop(&path, &origins, rx, file, written);
        })?;
        Ok(Self { tx, unpersisted: metrics::counter!("kvcached_vllm_export_unpersisted_total") })
    }

    /// Queues the record of a block G3 now holds (never blocks: a full queue is counted).
    pub(crate) fn append(&self, key: BlockKey, o: &Origin) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.tx.try_send(Msg::Record(Record::of(key, o)))
        {
            self.unpersisted.increment(1);
        }
    }

    /// Waits (at most `timeout`) until every record queued so far is written: at shutdown, after
    /// the write-through has drained into G3.
    pub(crate) fn flush(&self, timeout: Duration) -> bool {
        let (done_tx, done) = sync_channel(1);
        self.tx.send(Msg::Flush(done_tx)).is_ok() && done.recv_timeout(timeout).is_ok()
    }
}

fn write_loop(path: &Path, origins: &Origins, rx: Receiver<Msg>, file: File, mut rewritten: u64) {
    let mut out = BufWriter::new(file);
    let mut size = rewritten;
    let mut buf = Vec::new();
    let mut flushed = Vec::new();
    let mut warned = false;
    while let Ok(first) = rx.recv() {
        buf.clear();
        let mut take = |m: Msg, buf: &mut Vec<u8>| match m {
            Msg::Record(r) => encode(&r, buf),
            Msg::Flush(done) => flushed.push(done),
        };
        take(first, &mut buf);
        while let Ok(m) = rx.try_recv() {
            take(m, &mut buf);
        }
        let appended = out.write_all(&buf).and_then(|_| out.flush());
        if let Err(e) = &appended
            && !warned
        {
            tracing::warn!(path = %path.display(), "cannot append to the vLLM export's G3 records: {e}; rewriting them");
            warned = true;
        }
        size += buf.len() as u64;
        // A failed append may have left half a record, which would hide every later one: rewrite
        // now. Otherwise rewrite once the log has grown fourfold.
        if appended.is_err() || (size > MIN_REWRITE_BYTES && size > 4 * rewritten) {
            match rewrite(path, origins) {
                Ok((file, n)) => {
                    out = BufWriter::new(file);
                    (size, rewritten, warned) = (n, n, false);
                }
                Err(e) => {
                    // Try again only after as much growth again (a full disk stays full a while).
                    rewritten = size;
                    if !warned {
                        tracing::warn!(path = %path.display(), "cannot rewrite the vLLM export's G3 records: {e}");
                        warned = true;
                    }
                }
            }
        }
        for done in flushed.drain(..) {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            failure_persistence: None,
            ..Default::default()
        })]
        /// The log from arbitrary bytes (a damaged file): records up to the first bad one, and no
        /// panic (`docs/operations/security-limits.md`, "Fuzzing").
        #[test]
        fn arbitrary_logs_decode_without_panic(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            let _ = decode_all(&b);
            let _ = decode_body(&b);
        }
    }

    #[test]
    fn records_round_trip_and_a_damaged_tail_is_dropped() {
        let recs = [
            Record { key: BlockKey([1; 16]), hash: 7, parent: None, tokens: vec![1, 2, 3].into(), lora: None },
            Record {
                key: BlockKey([2; 16]),
                hash: 8,
                parent: Some(7),
                tokens: vec![u32::MAX; 16].into(),
                lora: Some("sql-lora".into()),
            },
            Record { key: BlockKey([3; 16]), hash: 9, parent: Some(8), tokens: Vec::<u32>::new().into(), lora: None },
        ];
        let mut data = Vec::new();
        for r in &recs {
            encode(r, &mut data);
        }
        let back = decode_all(&data);
        assert_eq!(back.len(), 3);
        for (a, b) in recs.iter().zip(&back) {
            assert_eq!((a.key, a.hash, a.parent, &a.tokens, &a.lora), (b.key, b.hash, b.parent, &b.tokens, &b.lora));
        }
        // A torn last record, then a flipped byte in the second: only what precedes survives.
        assert_eq!(decode_all(&data[..data.len() - 1]).len(), 2);
        let mut bad = data.clone();
        let second = 12 + FIXED + 12 + 3 * 4 + 5;
        bad[second] ^= 1;
        assert_eq!(decode_all(&bad).len(), 1);
        assert!(decode_all(&[]).is_empty());
    }
}
