//! The two-node walk-through of `docs/operations/two-nodes.md`,
//! run as written: the first ```bash block after `<!-- walkthrough -->`, in an empty
//! directory, with `kvcached` and `engine` on PATH. Its every step must succeed, the decode
//! node must load every block byte-exact from the peer, before and after the prefill node's
//! restart, and end ready.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

fn script() -> String {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations/two-nodes.md")).unwrap();
    let after = doc.split("<!-- walkthrough -->").nth(1).expect("two-nodes.md has no <!-- walkthrough --> marker");
    let body = after.split("```bash\n").nth(1).expect("no ```bash block after the marker");
    body.split("\n```").next().unwrap().to_string()
}

#[test]
fn the_two_node_walkthrough_runs_as_written() {
    let d = tempfile::tempdir().unwrap();
    let bin = d.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // The `daemon` test binary is kvcached's command line, built in this package.
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_daemon"), bin.join("kvcached")).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_engine"), bin.join("engine")).unwrap();
    let work = d.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script()])
        .current_dir(&work)
        .env("PATH", path)
        .env_remove("KVCACHED_SOCKET")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let logs = ["a.log", "b.log"].map(|f| std::fs::read_to_string(work.join(f)).unwrap_or_default());
    let all = format!("stdout:\n{stdout}\nstderr:\n{stderr}\nA:\n{}\nB:\n{}", logs[0], logs[1]);
    assert!(out.status.success(), "the walk-through failed\n{all}");
    let loads: Vec<&str> = stdout.lines().filter(|l| l.starts_with("loaded ")).collect();
    assert_eq!(loads, ["loaded 8 blocks (G2 0, G3 0, peer 8); 8 byte-exact"; 2], "{all}");
    assert!(stdout.contains("kvcached_peer_pulled_blocks_total 8"), "{all}");
    assert!(stdout.trim_end().ends_with("ok"), "{all}");
}
