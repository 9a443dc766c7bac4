//! A real NATS server with JetStream for the event-plane tests: Debian's `nats-server` (2.9,
//! installed by `scripts/test`; `KVCACHED_NATS_SERVER` names another binary), bound to
//! 127.0.0.1 on a port of its own, its store in the test's directory, users with the NATS
//! permissions `docs/router.md` documents for a daemon and a router. Killed (and restarted on the
//! same port and store) at will.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvnet::bus::NatsConfig;

/// The deployment name (subject token) the tests use.
pub const CLUSTER: &str = "test";
/// The router's user and password.
pub const ROUTER_USER: (&str, &str) = ("router", "router-secret");

/// A running nats-server; killed when dropped.
#[derive(Debug)]
pub struct Nats {
    child: Option<Child>,
    dir: PathBuf,
    /// The port it listens on (the same across restarts).
    pub port: u16,
}

/// The `nats-server` binary: `KVCACHED_NATS_SERVER`, else the first on PATH or in /usr/sbin.
pub fn nats_server() -> PathBuf {
    if let Some(p) = std::env::var_os("KVCACHED_NATS_SERVER") {
        return PathBuf::from(p);
    }
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/usr/local/sbin"])
        .map(|d| Path::new(d).join("nats-server"))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nats-server"))
}

/// The password of `node`'s daemon user (`daemon-<node>`).
pub fn daemon_password(node: &str) -> String {
    format!("{node}-secret")
}

impl Nats {
    /// Starts a server with users `router` and `daemon-<node>` for each of `nodes`, each
    /// confined to the subjects `docs/router.md` lists.
    pub fn start(dir: &Path, nodes: &[&str]) -> Self {
        let stream = NatsConfig::default().stream;
        let api = "$JS.API";
        let mut users = vec![format!(
            "{{ user: \"{}\", password: \"{}\", permissions: {{ publish: [\"{api}.STREAM.INFO.{stream}\", \
             \"{api}.STREAM.CREATE.{stream}\", \"{api}.CONSUMER.CREATE.{stream}\", \"{api}.CONSUMER.CREATE.{stream}.>\", \
             \"{api}.CONSUMER.MSG.NEXT.{stream}.>\", \"{api}.CONSUMER.DELETE.{stream}.>\", \"{api}.CONSUMER.INFO.{stream}.>\"], \
             subscribe: [\"_INBOX.>\"] }} }}",
            ROUTER_USER.0, ROUTER_USER.1
        )];
        let subjects = NatsConfig { cluster: CLUSTER.into(), ..NatsConfig::default() };
        for n in nodes {
            users.push(format!(
                "{{ user: \"daemon-{n}\", password: \"{}\", permissions: {{ publish: [\"{api}.STREAM.INFO.{stream}\", \
                 \"{api}.STREAM.CREATE.{stream}\", \"{}\"], subscribe: [\"_INBOX.>\"] }} }}",
                daemon_password(n),
                subjects.subject(n)
            ));
        }
        Self::start_conf(dir, &format!("authorization {{ users = [\n{}\n] }}\n", users.join(",\n")))
    }

    /// Starts a server without users: anyone reaching the port may publish and read (for
    /// benchmarks on loopback only).
    pub fn start_open(dir: &Path) -> Self {
        Self::start_conf(dir, "")
    }

    /// A server with `auth` as its authorization block, on a port and a store of its own.
    fn start_conf(dir: &Path, auth: &str) -> Self {
        let port = crate::proc::free_port();
        std::fs::create_dir_all(dir.join("js")).unwrap();
        let conf = format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: \"{}\" }}\n{auth}",
            dir.join("js").display()
        );
        std::fs::write(dir.join("nats.conf"), conf).unwrap();
        let mut s = Self { child: None, dir: dir.to_path_buf(), port };
        s.spawn();
        s
    }

    /// The server's process id (while it runs).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self) {
        let bin = nats_server();
        let log = std::fs::File::create(self.dir.join("nats.out")).ok();
        let child = Command::new(&bin)
            .arg("-c")
            .arg(self.dir.join("nats.conf"))
            .stdin(Stdio::null())
            .stdout(log.as_ref().and_then(|f| f.try_clone().ok()).map_or(Stdio::null(), Stdio::from))
            .stderr(log.map_or(Stdio::null(), Stdio::from))
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e} (scripts/test installs Debian's nats-server)", bin.display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nats.out")).unwrap_or_default()
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL); its store stays.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    fn base_config(port: u16, password_file: &str) -> NatsConfig {
        let mut c = NatsConfig {
            servers: vec![format!("nats://127.0.0.1:{port}")],
            cluster: CLUSTER.into(),
            ..NatsConfig::default()
        };
        if !password_file.is_empty() {
            c.auth.password_file = Some(password_file.into());
        }
        c
    }

    /// The router's configuration of this bus (its password written into `dir`).
    pub fn router_config(&self, dir: &Path) -> NatsConfig {
        let pw = dir.join("router.password");
        std::fs::write(&pw, ROUTER_USER.1).unwrap();
        let mut c = Self::base_config(self.port, &pw.display().to_string());
        c.auth.user = Some(ROUTER_USER.0.into());
        c
    }

    /// The `[events]` TOML section of `node`'s daemon (its password written into `dir`).
    pub fn daemon_toml(&self, dir: &Path, node: &str) -> String {
        let pw = dir.join(format!("{node}.password"));
        std::fs::write(&pw, daemon_password(node)).unwrap();
        format!(
            "[events]\ntransport = \"nats\"\n[events.nats]\nservers = [\"{}\"]\ncluster = \"{CLUSTER}\"\n\
             [events.nats.auth]\nuser = \"daemon-{node}\"\npassword_file = \"{}\"\n",
            self.url(),
            pw.display()
        )
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}
