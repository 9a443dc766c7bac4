//! Redis as a peer: Debian's `redis-server` on a loopback port (no persistence, `maxmemory` of
//! the run's capacity with LRU eviction), and the same 2 MiB pages as kvcached's blocks, one
//! value each, through RESP spoken here over one TCP connection with every command of a
//! request pipelined (its best path for one client: one round trip per request and operation).
//! Lookup: `EXISTS` of each page's key, in prompt order, counted up to the first absent one;
//! retrieve: `GET` of the cached prefix, read straight into the engine's buffer; store: `SET` of
//! the rest from it. Values are contiguous here: an engine with vLLM's layer-separate tensors
//! would also have to gather each page's 64 segments first, which kvcached's daemon does in its
//! one copy.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{PAGE_BYTES, PAGES_PER_HASH, PeerConfig, Recorder, SystemResult, WARM_BASE};
use crate::replay::cluster::{free_port, tail};

/// A `redis-server` process, killed when dropped.
struct Server(Option<Child>);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One RESP connection: commands written through a buffer, replies read through another.
struct Conn {
    w: BufWriter<TcpStream>,
    r: BufReader<TcpStream>,
}

impl Conn {
    fn connect(port: u16) -> std::io::Result<Self> {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(Self { w: BufWriter::with_capacity(1 << 16, s.try_clone()?), r: BufReader::with_capacity(1 << 16, s) })
    }

    /// Queues a command whose last argument is `value` (written from the caller's buffer: a
    /// large value goes from it to the socket without another copy).
    fn send(&mut self, args: &[&[u8]], value: Option<&[u8]>) -> std::io::Result<()> {
        let n = args.len() + usize::from(value.is_some());
        write!(self.w, "*{n}\r\n")?;
        for a in args.iter().copied().chain(value) {
            write!(self.w, "${}\r\n", a.len())?;
            self.w.write_all(a)?;
            self.w.write_all(b"\r\n")?;
        }
        Ok(())
    }

    fn line(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        self.r.read_line(&mut l)?;
        if !l.ends_with("\r\n") {
            return Err(std::io::Error::other(format!("short reply line {l:?}")));
        }
        l.truncate(l.len() - 2);
        Ok(l)
    }

    /// Reads a status or integer reply.
    fn simple(&mut self) -> std::io::Result<String> {
        let l = self.line()?;
        match l.as_bytes().first() {
            Some(b'+' | b':') => Ok(l[1..].to_string()),
            _ => Err(std::io::Error::other(format!("redis: {l}"))),
        }
    }

    /// Reads a bulk reply into `into` (which must be its length); false for a nil reply.
    fn bulk_into(&mut self, into: &mut [u8]) -> std::io::Result<bool> {
        let l = self.line()?;
        let Some(len) = l.strip_prefix('$') else { return Err(std::io::Error::other(format!("redis: {l}"))) };
        let len: i64 = len.parse().map_err(|_| std::io::Error::other(format!("redis: {l}")))?;
        if len < 0 {
            return Ok(false);
        }
        if len as usize != into.len() {
            return Err(std::io::Error::other(format!("redis: a value of {len} bytes, not {}", into.len())));
        }
        self.r.read_exact(into)?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf)?;
        Ok(true)
    }
}

fn key(h: u64, page: u32) -> Vec<u8> {
    format!("kv:{h}:{page}").into_bytes()
}

fn keys(ids: &[u64]) -> Vec<Vec<u8>> {
    ids.iter().flat_map(|&h| (0..PAGES_PER_HASH).map(move |p| key(h, p))).collect()
}

/// Pages `[from, to)` of `keys` SET from the engine buffer.
fn set(c: &mut Conn, keys: &[Vec<u8>], mem: &[u8], from: usize, to: usize) -> std::io::Result<()> {
    let n = PAGE_BYTES as usize;
    for (i, k) in keys.iter().enumerate().take(to).skip(from) {
        c.send(&[b"SET", k], Some(&mem[i * n..(i + 1) * n]))?;
    }
    c.w.flush()?;
    for _ in from..to {
        c.simple()?;
    }
    Ok(())
}

/// Pages `[0, to)` of `keys` GET into the engine buffer; how many arrived before a nil.
fn get(c: &mut Conn, keys: &[Vec<u8>], mem: &mut [u8], to: usize) -> std::io::Result<usize> {
    let n = PAGE_BYTES as usize;
    for k in &keys[..to] {
        c.send(&[b"GET", k], None)?;
    }
    c.w.flush()?;
    let mut got = 0;
    let mut gap = false;
    for i in 0..to {
        // Every reply is read, even past a nil (evicted since the lookup), to keep the
        // connection in step.
        let ok = c.bulk_into(&mut mem[i * n..(i + 1) * n])?;
        if ok && !gap {
            got += 1;
        } else {
            gap = true;
        }
    }
    Ok(got)
}

/// Leading pages of `keys` that exist.
fn exists_prefix(c: &mut Conn, keys: &[Vec<u8>]) -> std::io::Result<usize> {
    for k in keys {
        c.send(&[b"EXISTS", k], None)?;
    }
    c.w.flush()?;
    let mut prefix = 0;
    let mut gap = false;
    for _ in keys {
        let present = c.simple()? == "1";
        if present && !gap {
            prefix += 1;
        } else {
            gap = true;
        }
    }
    Ok(prefix)
}

/// Runs the workload on a fresh `redis-server`.
pub fn run(cfg: &PeerConfig, bin: &Path) -> Result<SystemResult, String> {
    let version = Command::new(bin)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .map_err(|e| format!("{}: {e} (Debian: `source scripts/lib.sh && need_debs redis-server`)", bin.display()))?;
    let dir = cfg.dir.join("redis");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let port = free_port()?;
    let log = dir.join("redis.log");
    let args = [
        "--port".to_string(),
        port.to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--protected-mode".into(),
        "yes".into(),
        "--save".into(),
        String::new(),
        "--appendonly".into(),
        "no".into(),
        "--maxmemory".into(),
        cfg.capacity_bytes.to_string(),
        "--maxmemory-policy".into(),
        "allkeys-lru".into(),
        "--daemonize".into(),
        "no".into(),
        "--dir".into(),
        dir.display().to_string(),
        "--logfile".into(),
        log.display().to_string(),
    ];
    let setup = format!(
        "{} {}",
        bin.display(),
        args.iter().map(|a| if a.is_empty() { "''" } else { a }).collect::<Vec<_>>().join(" ")
    );
    let child = Command::new(bin)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", bin.display()))?;
    let _server = Server(Some(child));
    let t0 = Instant::now();
    let mut c = loop {
        match Conn::connect(port) {
            Ok(mut c) => {
                c.send(&[b"PING"], None).map_err(|e| e.to_string())?;
                c.w.flush().map_err(|e| e.to_string())?;
                if c.simple().is_ok() {
                    break c;
                }
            }
            Err(_) if t0.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("redis-server did not answer: {e}: {}", tail(&log, 1000))),
        }
    };
    let pages = cfg.max_pages() as usize;
    let n = PAGE_BYTES as usize;
    let mut mem = vec![0u8; pages * n];
    for p in 0..pages {
        mem[p * n..(p + 1) * n].copy_from_slice(&kvclient::synthetic_block(p as u64, p as u32, n));
    }
    let io = |e: std::io::Error| format!("redis: {e}");
    let t0 = Instant::now();
    for i in 0..cfg.warmup_requests() {
        let k = keys(&[WARM_BASE + i]);
        set(&mut c, &k, &mem, 0, k.len()).map_err(io)?;
        get(&mut c, &k, &mut mem, k.len()).map_err(io)?;
    }
    let warm = t0.elapsed().as_secs_f64();
    let mut rec = Recorder::default();
    for (i, ids) in cfg.requests.iter().enumerate() {
        let k = keys(ids);
        let t0 = Instant::now();
        let hit = exists_prefix(&mut c, &k).map_err(io)?;
        rec.lookup(t0.elapsed(), hit as u64, k.len() as u64);
        let mut have = 0;
        if hit > 0 {
            let t0 = Instant::now();
            have = get(&mut c, &k, &mut mem, hit).map_err(io)?;
            rec.retrieve(have as u64 * PAGE_BYTES, t0.elapsed());
            if have < hit {
                rec.error(format!("request {i}: {} of {hit} pages gone between EXISTS and GET", hit - have));
            }
        }
        if have < k.len() {
            let t0 = Instant::now();
            set(&mut c, &k, &mem, have, k.len()).map_err(io)?;
            rec.store((k.len() - have) as u64 * PAGE_BYTES, t0.elapsed());
        }
    }
    Ok(rec.finish("redis", version, setup, warm))
}
