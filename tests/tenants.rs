//! Tenants under load (`server/src/tenants.rs`): a tenant salt belongs to one tenant (the uid
//! that registers engines), per-tenant G2 quotas make a tenant evict its own blocks rather than
//! another's, and lookups of one tenant never reach another's entries. The daemon runs as root
//! in this process (tenant `a`); tenant `b` is `src/bin/intruder.rs` as uid 65534. Skipped (with
//! a message) when not root, like `security.rs`.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use kvcached::tenants::TenantConfig;
use kvcached::{Config, Listeners};
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::Namespace;
use kvtests::{tenant_layout, tenant_prompt};

const NOBODY: u32 = 65534;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// BLAKE3 of a salt, as `[[tenants]] salts_blake3` holds it (`b3sum` of the salt's bytes).
fn b3(salt: &str) -> String {
    blake3::hash(salt.as_bytes()).to_hex().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salts_are_bound_to_tenants_and_quotas_evict_only_their_own() {
    if !is_root() {
        eprintln!("skipped: needs root (another uid plays tenant b)");
        return;
    }
    let block = tenant_layout().block_bytes();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = Config {
        socket: dir.path().join("kvcached.sock"),
        socket_mode: "0666".into(),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    c.g2.capacity_bytes = 64 << 20;
    c.g2.shm_dir = dir.path().to_path_buf();
    c.g3.enabled = false;
    c.tenants = vec![
        TenantConfig { name: "a".into(), uids: vec![0], g2_quota_bytes: 4 * block, ..Default::default() },
        TenantConfig { name: "b".into(), uids: vec![NOBODY], salts_blake3: vec![b3("salt-b")], ..Default::default() },
    ];
    let c = c.resolve().unwrap();
    let l = Listeners::bind(&c).await.unwrap();
    let http = l.http.as_ref().unwrap().local_addr().unwrap();
    let socket = c.socket.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvcached::serve(c, l, async move {
        let _ = rx.await;
    }));
    let bin = dir.path().join("intruder");
    std::fs::copy(env!("CARGO_BIN_EXE_intruder"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let b = |args: &[&str]| {
        let out = Command::new(&bin).arg(&socket).arg("tenant").args(args).uid(NOBODY).gid(NOBODY).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };

    // Tenant b saves 6 blocks under its pinned salt and finds them.
    assert_eq!(b(&["salt-b", "6", "6"]), "register=Ok saved=6 matched=6");

    // Tenant a cannot name b's salt, pinned or first registered.
    let mut mem = KvMemory::anonymous(&tenant_layout(), 8).unwrap();
    for s in 0..8 {
        mem.write_block(s, &synthetic_block(3, s, block as usize));
    }
    let salted = |salt: &str| {
        let mut ns = Namespace::new("m", tenant_layout());
        ns.tenant_salt = Some(salt.as_bytes().to_vec());
        ns
    };
    let a = Client::connect(&socket).await.unwrap();
    let e = a.register("a", &salted("salt-b"), &mem).await.unwrap_err().to_string();
    assert!(e.contains("belongs to another tenant"), "{e}");
    assert!(b(&["salt-b2", "1", "1"]).starts_with("register=Ok"), "b's second salt, first registered by b");
    let e = a.register("a", &salted("salt-b2"), &mem).await.unwrap_err().to_string();
    assert!(e.contains("belongs to another tenant"), "{e}");

    // Tenant a, with its own salt, saves 8 blocks against a quota of 4: it evicts its own oldest.
    a.register("a", &salted("salt-a"), &mem).await.unwrap();
    let prompt = tenant_prompt(8);
    let r = a.save(&prompt, 0, &(0..8).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(r.stored, 8, "{r:?}");
    // Its first blocks went (a prefix lookup stops at the first miss): only 4 of its blocks
    // remain, the last ones.
    assert_eq!(a.lookup(&prompt).await.unwrap().matched_blocks, 0);
    let evicted: f64 = reqwest::get(format!("http://{http}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("kvcached_tenant_quota_evictions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(evicted, 4.0);
    // Tenant b's blocks are all still there; a's lookups of the same tokens (unsalted, or its
    // own salt) never reach them.
    assert_eq!(b(&["salt-b", "0", "6"]), "register=Ok saved=0 matched=6");
    assert_eq!(a.lookup(&prompt[..96]).await.unwrap().matched_blocks, 0);
    let plain = Client::connect(&socket).await.unwrap();
    plain.register("plain", &Namespace::new("m", tenant_layout()), &mem).await.unwrap();
    assert_eq!(plain.lookup(&prompt[..96]).await.unwrap().matched_blocks, 0);

    drop((a, plain));
    let _ = tx.send(());
    task.await.unwrap().unwrap();
}
