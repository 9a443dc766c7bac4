//! What the soak samples (`/proc/PID/{status,fd,maps}` of the daemon and the router, the run's
//! shared-memory directory, `/dev/shm`, a few daemon and router metrics, the latency of each
//! operation over the interval), one CSV row per sample, and the verdict: a least-squares line
//! through each series over the second half of the run, whose rise across that half must stay
//! within [`BOUNDS`].

use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::SoakArgs;
use super::engine::{Counters, OPS, Recorder, metric};

/// A process's figures from `/proc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStat {
    /// `VmRSS`, `RssAnon`, `RssShmem` in MiB.
    pub rss_mib: f64,
    pub anon_mib: f64,
    pub shmem_mib: f64,
    /// Open file descriptors (`/proc/PID/fd`), and those of them open on files under the
    /// directory [`proc_stat`] was given (the daemon: G3's RocksDB index, whose SST files come
    /// and go with flushes and compactions, up to its `max_open_files` of 64).
    pub fds: f64,
    pub index_fds: f64,
    pub threads: f64,
    /// Memory mappings (lines of `/proc/PID/maps`).
    pub maps: f64,
}

/// Reads `/proc/PID`; zeros when the process is gone. `index` names the directory whose open
/// files are counted apart.
pub fn proc_stat(pid: u32, index: Option<&Path>) -> ProcStat {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let links: Vec<std::path::PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).collect())
        .unwrap_or_default();
    let index_fds = index.map_or(0, |dir| links.iter().filter(|l| l.starts_with(dir)).count());
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map(|s| s.lines().count() as f64).unwrap_or(0.0);
    ProcStat {
        rss_mib: field("VmRSS:") / 1024.0,
        anon_mib: field("RssAnon:") / 1024.0,
        shmem_mib: field("RssShmem:") / 1024.0,
        fds: links.len() as f64,
        index_fds: index_fds as f64,
        threads: field("Threads:"),
        maps,
    }
}

/// Bytes allocated by the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.blocks() * 512).sum())
        .unwrap_or(0)
}

/// The names of the files left in `dir`.
pub fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned())).collect())
        .unwrap_or_default()
}

/// Used bytes of the filesystem at `path` (for `/dev/shm`: every process's shared memory).
fn fs_used_bytes(path: &Path) -> u64 {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return 0 };
    // SAFETY: statvfs into a zeroed struct we own, with a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    (s.f_blocks - s.f_bfree) * s.f_frsize
}

/// `GET url`'s body; empty when nothing answers.
pub async fn get_text(http: &reqwest::Client, url: &str) -> String {
    match http.get(url).timeout(Duration::from_secs(5)).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// p50, p99 of sorted microseconds (0 when empty).
fn p50_p99(v: &[u32]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let at = |q: f64| f64::from(v[((v.len() as f64 - 1.0) * q).round() as usize]);
    (at(0.5), at(0.99))
}

/// One operation over one interval.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpLat {
    pub n: usize,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// One sample.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub t_s: f64,
    pub daemon: ProcStat,
    pub router: ProcStat,
    /// The run's own shared-memory directory (G2 pool, named engine KV files), MiB.
    pub shm_dir_mib: f64,
    /// `/dev/shm` as a whole, every process of the machine (for reference only), MiB.
    pub dev_shm_used_mib: f64,
    /// `kvcached_connections`, `kvcached_tier_blocks{tier}`.
    pub connections: f64,
    pub g2_blocks: f64,
    pub g3_blocks: f64,
    /// The router's `indexed_blocks` and `workers` (`/healthz`).
    pub router_blocks: f64,
    pub router_workers: f64,
    /// Cumulative counts.
    pub requests: u64,
    pub errors: u64,
    pub wrong_blocks: u64,
    pub reregisters: u64,
    pub reconnects: u64,
    pub ops: [OpLat; 6],
}

/// The series fitted, their CSV names and units, and how much each may rise over the second
/// half of the run (by the fitted line) before the soak fails. RSS in MiB; the rest in counts.
/// The allowances cover what the 10-minute run on the 2-core VM shows as noise (the allocator
/// keeping freed pages, blocking-pool threads that come and go, connections being replaced) with
/// a margin; a leak of one descriptor, mapping or thread per reconnect (about 0.25 / s) exceeds
/// them several times over, as does a leak of one 128 KiB block buffer per second.
pub const BOUNDS: [(&str, &str, f64); 10] = [
    ("daemon_rss_mib", "MiB", 32.0),
    ("daemon_anon_mib", "MiB", 24.0),
    ("daemon_fds_other", "fds", 4.0),
    ("daemon_threads", "threads", 4.0),
    ("daemon_maps", "mappings", 16.0),
    ("router_rss_mib", "MiB", 8.0),
    ("router_fds", "fds", 4.0),
    ("router_threads", "threads", 2.0),
    ("shm_dir_mib", "MiB", 1.0),
    ("daemon_shmem_mib", "MiB", 16.0),
];

impl Row {
    /// The CSV header (the same names as [`Row::csv`]'s columns).
    pub fn header() -> String {
        let mut h = String::from(
            "t_s,daemon_rss_mib,daemon_anon_mib,daemon_shmem_mib,daemon_fds,daemon_index_fds,daemon_threads,daemon_maps,\
             router_rss_mib,router_anon_mib,router_fds,router_threads,router_maps,shm_dir_mib,dev_shm_used_mib,\
             connections,g2_blocks,g3_blocks,router_blocks,router_workers,requests,errors,wrong_blocks,reregisters,reconnects",
        );
        for (_, name) in OPS {
            h += &format!(",{name}_n,{name}_p50_us,{name}_p99_us");
        }
        h
    }

    pub fn csv(&self) -> String {
        let (d, r) = (&self.daemon, &self.router);
        let mut s = format!(
            "{:.1},{:.2},{:.2},{:.2},{},{},{},{},{:.2},{:.2},{},{},{},{:.2},{:.1},{},{},{},{},{},{},{},{},{},{}",
            self.t_s,
            d.rss_mib,
            d.anon_mib,
            d.shmem_mib,
            d.fds,
            d.index_fds,
            d.threads,
            d.maps,
            r.rss_mib,
            r.anon_mib,
            r.fds,
            r.threads,
            r.maps,
            self.shm_dir_mib,
            self.dev_shm_used_mib,
            self.connections,
            self.g2_blocks,
            self.g3_blocks,
            self.router_blocks,
            self.router_workers,
            self.requests,
            self.errors,
            self.wrong_blocks,
            self.reregisters,
            self.reconnects
        );
        for o in &self.ops {
            s += &format!(",{},{:.0},{:.0}", o.n, o.p50_us, o.p99_us);
        }
        s
    }

    /// A fitted series by its CSV name.
    pub fn value(&self, series: &str) -> f64 {
        match series {
            "daemon_rss_mib" => self.daemon.rss_mib,
            "daemon_anon_mib" => self.daemon.anon_mib,
            "daemon_shmem_mib" => self.daemon.shmem_mib,
            "daemon_fds" => self.daemon.fds,
            "daemon_fds_other" => self.daemon.fds - self.daemon.index_fds,
            "daemon_threads" => self.daemon.threads,
            "daemon_maps" => self.daemon.maps,
            "router_rss_mib" => self.router.rss_mib,
            "router_fds" => self.router.fds,
            "router_threads" => self.router.threads,
            "shm_dir_mib" => self.shm_dir_mib,
            _ => f64::NAN,
        }
    }

    /// One line for the terminal.
    pub fn progress(&self) -> String {
        let o = |i: usize| format!("{:.0}/{:.0}", self.ops[i].p50_us, self.ops[i].p99_us);
        format!(
            "[{:>6.0} s] kvcached rss {:.0} MiB (anon {:.0}) fds {} threads {} maps {} | kvrouter rss {:.0} MiB fds {} \
             threads {} | shm {:.0} MiB | G2 {} G3 {} blocks | {} requests, {} errors | p50/p99 us: lookup {} load {} save {} route {}",
            self.t_s,
            self.daemon.rss_mib,
            self.daemon.anon_mib,
            self.daemon.fds,
            self.daemon.threads,
            self.daemon.maps,
            self.router.rss_mib,
            self.router.fds,
            self.router.threads,
            self.shm_dir_mib,
            self.g2_blocks,
            self.g3_blocks,
            self.requests,
            self.errors,
            o(1),
            o(2),
            o(3),
            o(0)
        )
    }
}

/// Takes the samples and appends them to `samples.csv`.
#[derive(Debug)]
pub struct Sampler {
    csv: std::fs::File,
    daemon: u32,
    router: u32,
    shm: std::path::PathBuf,
    index: std::path::PathBuf,
    daemon_metrics: String,
    router_health: String,
    http: reqwest::Client,
}

impl Sampler {
    pub fn new(
        out: &Path,
        daemon: u32,
        router: u32,
        shm: &Path,
        index: &Path,
        daemon_http: &str,
        router_base: &str,
    ) -> Result<Self, String> {
        let path = out.join("samples.csv");
        let mut csv = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        writeln!(csv, "{}", Row::header()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            csv,
            daemon,
            router,
            shm: shm.to_path_buf(),
            index: index.to_path_buf(),
            daemon_metrics: format!("http://{daemon_http}/metrics"),
            router_health: format!("{router_base}/healthz"),
            http: reqwest::Client::new(),
        })
    }

    /// One sample at `t` (the interval's latencies are drained from `rec`).
    pub async fn sample(&mut self, t: Duration, rec: &Recorder, c: &Counters) -> Result<Row, String> {
        let lat = rec.drain();
        let m = get_text(&self.http, &self.daemon_metrics).await;
        let health: serde_json::Value =
            serde_json::from_str(&get_text(&self.http, &self.router_health).await).unwrap_or_default();
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let row = Row {
            t_s: t.as_secs_f64(),
            daemon: proc_stat(self.daemon, Some(&self.index)),
            router: proc_stat(self.router, None),
            shm_dir_mib: mib(dir_bytes(&self.shm)),
            dev_shm_used_mib: mib(fs_used_bytes(Path::new("/dev/shm"))),
            connections: metric(&m, "kvcached_connections"),
            g2_blocks: metric(&m, "kvcached_tier_blocks{tier=\"g2\""),
            g3_blocks: metric(&m, "kvcached_tier_blocks{tier=\"g3\""),
            router_blocks: health["indexed_blocks"].as_f64().unwrap_or(0.0),
            router_workers: health["workers"].as_f64().unwrap_or(0.0),
            requests: c.requests.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            wrong_blocks: c.wrong_blocks.load(Ordering::Relaxed),
            reregisters: c.reregisters.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
            ops: std::array::from_fn(|i| {
                let (p50_us, p99_us) = p50_p99(&lat[i]);
                OpLat { n: lat[i].len(), p50_us, p99_us }
            }),
        };
        writeln!(self.csv, "{}", row.csv()).map_err(|e| format!("samples.csv: {e}"))?;
        Ok(row)
    }
}

/// Least-squares slope of `ys` over `xs` (0 with fewer than two points).
pub fn slope(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len() as f64;
    if xs.len() < 2 {
        return 0.0;
    }
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxy: f64 = xs.iter().zip(ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// One series' verdict.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fit {
    pub series: &'static str,
    pub unit: &'static str,
    pub first: f64,
    /// At the start of the second half, and at the end.
    pub mid: f64,
    pub last: f64,
    pub max: f64,
    /// Of the line through the second half, per minute.
    pub slope_per_min: f64,
    /// The line's rise across the second half.
    pub growth: f64,
    pub bound: f64,
    pub ok: bool,
}

/// How the run ended, besides the samples.
#[derive(Debug, Clone, Default)]
pub struct Ending {
    /// A process that died, or an engine task that panicked.
    pub died: Option<String>,
    pub daemon_stop: Option<String>,
    pub router_stop: Option<String>,
    /// Files in the run's shared-memory directory after the daemon stopped and the engines
    /// dropped their memory (expected: none; the daemon unlinks its pool).
    pub leftover_shm_files: Vec<String>,
}

/// Everything the soak concludes.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub minutes: f64,
    pub run_s: f64,
    pub samples: usize,
    pub engines: usize,
    pub g2_mib: u64,
    pub g3_mib: u64,
    pub fits: Vec<Fit>,
    /// Whole run, per operation: (name, count, p50 us, p99 us, the worst interval's p99 us).
    pub latency: Vec<(String, usize, f64, f64, f64)>,
    pub counts: serde_json::Value,
    pub failures: Vec<String>,
}

impl Report {
    pub fn new(a: &SoakArgs, rows: &[Row], rec: &Recorder, c: &Counters, run_s: f64, end: Ending) -> Self {
        let half = rows.last().map_or(0.0, |r| r.t_s / 2.0);
        let second: Vec<&Row> = rows.iter().filter(|r| r.t_s >= half).collect();
        let xs: Vec<f64> = second.iter().map(|r| r.t_s).collect();
        let span = xs.last().zip(xs.first()).map_or(0.0, |(l, f)| l - f);
        let fits: Vec<Fit> = BOUNDS
            .iter()
            .map(|&(series, unit, bound)| {
                let ys: Vec<f64> = second.iter().map(|r| r.value(series)).collect();
                let s = slope(&xs, &ys);
                let bound = bound * a.bound_scale;
                Fit {
                    series,
                    unit,
                    first: rows.first().map_or(0.0, |r| r.value(series)),
                    mid: ys.first().copied().unwrap_or(0.0),
                    last: ys.last().copied().unwrap_or(0.0),
                    max: rows.iter().map(|r| r.value(series)).fold(0.0, f64::max),
                    slope_per_min: s * 60.0,
                    growth: s * span,
                    bound,
                    ok: s * span <= bound,
                }
            })
            .collect();
        let all = rec.all();
        let latency = OPS
            .iter()
            .enumerate()
            .map(|(i, (_, name))| {
                let (p50, p99) = p50_p99(&all[i]);
                let worst = rows.iter().map(|r| r.ops[i].p99_us).fold(0.0, f64::max);
                (name.to_string(), all[i].len(), p50, p99, worst)
            })
            .collect();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let (requests, errors, wrong) = (load(&c.requests), load(&c.errors), load(&c.wrong_blocks));
        let counts = serde_json::json!({
            "requests": requests,
            "routed": load(&c.routed),
            "errors": errors,
            "wrong_blocks": wrong,
            "checked_blocks": load(&c.checked_blocks),
            "short_loads": load(&c.short_loads),
            "saved_blocks": load(&c.saved_blocks),
            "save_failed_blocks": load(&c.save_failed_blocks),
            "looked_blocks": load(&c.looked_blocks),
            "hit_blocks": load(&c.hit_blocks),
            "reregisters": load(&c.reregisters),
            "reconnects": load(&c.reconnects),
        });
        let mut failures: Vec<String> = fits
            .iter()
            .filter(|f| !f.ok)
            .map(|f| {
                format!("{} rose {:.2} {} over the second half (bound {:.2})", f.series, f.growth, f.unit, f.bound)
            })
            .collect();
        if wrong > 0 {
            failures.push(format!("{wrong} blocks loaded with wrong bytes"));
        }
        if requests == 0 {
            failures.push("no request was answered".into());
        } else if errors * 100 > requests {
            failures.push(format!("{errors} failed calls in {requests} requests (more than 1%)"));
        }
        if rows.len() < 4 {
            failures.push(format!("{} samples: too few to fit (a longer run or a shorter interval)", rows.len()));
        }
        failures.extend(end.died);
        failures.extend(end.daemon_stop.map(|e| format!("kvcached did not stop cleanly: {e}")));
        failures.extend(end.router_stop.map(|e| format!("kvrouter did not stop cleanly: {e}")));
        if !end.leftover_shm_files.is_empty() {
            failures.push(format!("files left in the shared-memory directory: {:?}", end.leftover_shm_files));
        }
        Self {
            minutes: a.minutes,
            run_s,
            samples: rows.len(),
            engines: a.engines,
            g2_mib: a.g2_mib,
            g3_mib: a.g3_mib,
            fits,
            latency,
            counts,
            failures,
        }
    }

    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    pub fn write_json(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn markdown(&self) -> String {
        let mut s = format!(
            "Soak: {:.0} s, {} samples, {} engines, G2 {} MiB + G3 {} MiB. Each series: first sample, start \
             of the second half, last sample, its line over the second half.\n\n\
             | series | first | 2nd half start | last | max | slope / min | rise over 2nd half | bound | ok |\n\
             |---|---|---|---|---|---|---|---|---|\n",
            self.run_s, self.samples, self.engines, self.g2_mib, self.g3_mib
        );
        for f in &self.fits {
            s += &format!(
                "| {} ({}) | {:.1} | {:.1} | {:.1} | {:.1} | {:+.3} | {:+.2} | {:.1} | {} |\n",
                f.series,
                f.unit,
                f.first,
                f.mid,
                f.last,
                f.max,
                f.slope_per_min,
                f.growth,
                f.bound,
                if f.ok { "yes" } else { "**no**" }
            );
        }
        s += "\n| operation | count | p50 (us) | p99 (us) | worst interval's p99 (us) |\n|---|---|---|---|---|\n";
        for (name, n, p50, p99, worst) in &self.latency {
            s += &format!("| {name} | {n} | {p50:.0} | {p99:.0} | {worst:.0} |\n");
        }
        s += &format!("\nCounts: {}\n", self.counts);
        if self.failures.is_empty() {
            s += "\nPASSED: every series within its bound, no wrong byte, clean stops, nothing left in /dev/shm.\n";
        } else {
            s += "\nFAILED:\n";
            for f in &self.failures {
                s += &format!("- {f}\n");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line() {
        let xs = [0.0, 1.0, 2.0, 3.0];
        assert!((slope(&xs, &[1.0, 3.0, 5.0, 7.0]) - 2.0).abs() < 1e-9);
        assert_eq!(slope(&xs, &[4.0; 4]), 0.0);
        assert_eq!(slope(&[1.0], &[1.0]), 0.0);
    }

    #[test]
    fn reads_its_own_proc() {
        let s = proc_stat(std::process::id(), Some(Path::new("/proc")));
        assert!(s.rss_mib > 0.0 && s.fds > 0.0 && s.threads >= 1.0 && s.maps > 0.0);
        assert!(s.index_fds >= 1.0, "the descriptor read_dir holds on /proc/PID/fd");
        assert_eq!(proc_stat(u32::MAX, None).rss_mib, 0.0);
    }

    #[test]
    fn every_bound_names_a_series() {
        let r = Row::default();
        assert!(BOUNDS.iter().all(|(s, _, _)| !r.value(s).is_nan()));
        assert_eq!(Row::header().split(',').count(), r.csv().split(',').count());
    }
}
