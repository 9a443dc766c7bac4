//! Tenants under load (`server/src/policy/tenants.rs`): a tenant salt belongs to one tenant (the uid
//! that registers engines), per-tenant G2, G3 and G4 quotas make a tenant evict its own blocks
//! rather than another's, and lookups of one tenant never reach another's entries. The daemon runs as root
//! in this process (tenant `a`); tenant `b` is `src/bin/intruder.rs` as uid 65534. Skipped (with
//! a message) when not root, like `security.rs`.
#![allow(clippy::unwrap_used)]

use kvcached::policy::tenants::TenantConfig;
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::Namespace;
use kvtests::inproc::InProcess;
use kvtests::{tenant_layout, tenant_prompt};

const NOBODY: u32 = 65534;

/// BLAKE3 of a salt, as `[[tenants]] salts_blake3` holds it (`b3sum` of the salt's bytes).
fn b3(salt: &str) -> String {
    blake3::hash(salt.as_bytes()).to_hex().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salts_are_bound_to_tenants_and_quotas_evict_only_their_own() {
    kvtests::require_root!("(another uid plays tenant b)");
    let block = tenant_layout().block_bytes();
    let d = InProcess::start(|c| {
        c.tenants = vec![
            TenantConfig { name: "a".into(), uids: vec![0], g2_quota_bytes: 4 * block, ..Default::default() },
            TenantConfig {
                name: "b".into(),
                uids: vec![NOBODY],
                salts_blake3: vec![b3("salt-b")],
                ..Default::default()
            },
        ];
    })
    .await;
    let socket = d.socket.clone();
    let b = |args: &[&str]| tenant_b(&d, args);

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

    // Tenant a, with its own salt, saves 8 blocks against a quota of 4: the first 4 are kept
    // (the rest would have to remove their own prefix) and the prompt stays findable.
    a.register("a", &salted("salt-a"), &mem).await.unwrap();
    let prompt = tenant_prompt(8);
    let r = a.save(&prompt, 0, &(0..8).collect::<Vec<_>>()).await.unwrap();
    assert_eq!((r.stored, r.failed), (4, 4), "{r:?}");
    assert!(r.error.contains("over the tenant's G2 quota"), "{r:?}");
    assert_eq!(a.lookup(&prompt).await.unwrap().matched_blocks, 4);
    // A second prompt of 2 blocks takes the room from the first one's end: its own blocks.
    let second: Vec<u32> = prompt[..32].iter().map(|t| t + 1).collect();
    assert_eq!(a.save(&second, 0, &[0, 1]).await.unwrap().stored, 2);
    assert_eq!(a.lookup(&second).await.unwrap().matched_blocks, 2);
    assert_eq!(a.lookup(&prompt).await.unwrap().matched_blocks, 2, "the first prompt keeps its first 2 blocks");
    assert_eq!(d.metric("kvcached_tenant_quota_evictions_total{tenant=\"a\",tier=\"g2\"}").await, 2.0);
    // Tenant b's blocks are all still there; a's lookups of the same tokens (its own salt, or
    // unsalted) never reach them: a finds its own 2, an unsalted engine none.
    assert_eq!(b(&["salt-b", "0", "6"]), "register=Ok saved=0 matched=6");
    assert_eq!(a.lookup(&prompt[..96]).await.unwrap().matched_blocks, 2);
    let plain = Client::connect(&socket).await.unwrap();
    plain.register("plain", &Namespace::new("m", tenant_layout()), &mem).await.unwrap();
    assert_eq!(plain.lookup(&prompt[..96]).await.unwrap().matched_blocks, 0);

    drop((a, plain));
    d.stop().await;
}

/// G3 and G4 quotas are applied by those tiers when the write-through reaches them: a block past
/// the tenant's quota there is not written (it would have to remove its own prefix), another
/// tenant's blocks all stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g3_and_g4_quotas_charge_blocks_where_they_land() {
    kvtests::require_root!("(another uid plays tenant b)");
    let block = tenant_layout().block_bytes();
    let g4 = tempfile::tempdir().unwrap();
    let g4_dir = g4.path().to_path_buf();
    let d = InProcess::start(|c| {
        c.tenants = vec![
            TenantConfig {
                name: "lower".into(),
                uids: vec![0],
                g3_quota_bytes: 4 * block,
                g4_quota_bytes: 6 * block,
                ..Default::default()
            },
            TenantConfig { name: "b".into(), uids: vec![NOBODY], ..Default::default() },
        ];
        {
            c.g3.enabled = true;
            c.g3.dir = c.g2.shm_dir.join("g3");
            c.g3.capacity_bytes = 64 << 20;
            c.g4.enabled = true;
            c.g4.url = format!("file://{}", g4_dir.display());
        }
    })
    .await;
    assert_eq!(tenant_b(&d, &["salt-b", "6", "6"]), "register=Ok saved=6 matched=6");

    let mut ns = Namespace::new("m", tenant_layout());
    ns.tenant_salt = Some(b"salt-a".to_vec());
    let mut mem = KvMemory::anonymous(&tenant_layout(), 16).unwrap();
    for s in 0..16 {
        mem.write_block(s, &synthetic_block(3, s, block as usize));
    }
    let a = Client::connect(&d.socket).await.unwrap();
    a.register("a", &ns, &mem).await.unwrap();
    let prompt = tenant_prompt(16);
    assert_eq!(a.save(&prompt, 0, &(0..16).collect::<Vec<_>>()).await.unwrap().stored, 16);

    // a keeps the first 4 blocks in G3 and the first 6 in G4 (each tier takes a batch in the
    // chain's order), b all 6 in both; nothing of a's had to be removed. Tenant a is named
    // "lower" here: the tests share the process's metrics.
    let metric = |name: &'static str, tier: &'static str| {
        d.metric(format!("kvcached_tenant_quota_{name}_total{{tenant=\"lower\",tier=\"{tier}\"}}"))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while metric("refused", "g3").await < 12.0
        || metric("refused", "g4").await < 10.0
        || objects(&g4_dir).len() < 12
        || d.metric("kvcached_tier_blocks{tier=\"g3\"}").await < 10.0
    {
        if std::time::Instant::now() >= deadline {
            let (r3, r4) = (metric("refused", "g3").await, metric("refused", "g4").await);
            let g3 = d.metric("kvcached_tier_blocks{tier=\"g3\"}").await;
            let dropped =
                d.metric("kvcached_writethrough_dropped_total{reason=\"gone_before_write\",tier=\"g4\"}").await;
            panic!(
                "the quotas were not applied: refused g3 {r3} g4 {r4}, g3 blocks {g3}, g4 gone {dropped}: {:?}",
                objects(&g4_dir)
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!((metric("refused", "g3").await, metric("refused", "g4").await), (12.0, 10.0));
    assert_eq!((metric("evictions", "g3").await, metric("evictions", "g4").await), (0.0, 0.0));
    let all: std::collections::BTreeSet<String> =
        ns.block_keys(&prompt).iter().take(6).map(|k| k.to_string()).collect();
    let in_g4 = objects(&g4_dir);
    let a_dir: String = ns.id().0.iter().map(|x| format!("{x:02x}")).collect();
    let a_objects: std::collections::BTreeSet<String> =
        in_g4.iter().filter(|(n, _)| *n == a_dir).map(|(_, k)| k.clone()).collect();
    assert_eq!(a_objects, all, "a keeps its prompt's first 6 blocks in G4");
    assert_eq!(in_g4.len(), 12, "b's 6 objects all stay: {in_g4:?}");
    assert_eq!(d.metric("kvcached_tier_blocks{tier=\"g3\"}").await, 10.0, "a's 4 and b's 6 in G3");
    let charged =
        |tier: &'static str| d.metric(format!("kvcached_tenant_charged_bytes{{tenant=\"lower\",tier=\"{tier}\"}}"));
    assert_eq!((charged("g3").await, charged("g4").await), ((4 * block) as f64, (6 * block) as f64));
    drop(a);
    d.stop().await;
}

/// (namespace directory, object name) of every object under a `file://` G4.
fn objects(root: &std::path::Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if let (Some(ns), Some(name)) = (
                p.parent().and_then(|n| n.file_name()).map(|n| n.to_string_lossy().to_string()),
                p.file_name().map(|n| n.to_string_lossy().to_string()),
            ) && !name.starts_with('.')
            {
                out.push((ns, name));
            }
        }
    }
    out
}

/// `intruder SOCKET tenant ARGS` as uid 65534: tenant b's engine.
fn tenant_b(d: &InProcess, args: &[&str]) -> String {
    let all: Vec<&str> = std::iter::once("tenant").chain(args.iter().copied()).collect();
    d.say_as(std::path::Path::new(env!("CARGO_BIN_EXE_intruder")), NOBODY, &all)
}
