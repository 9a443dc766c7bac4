//! The `kvcached` command line, as the binary.
#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn cli_help_config_and_invalid_configuration() {
    let bin = env!("CARGO_BIN_EXE_kvcached");
    let help = Command::new(bin).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in ["--socket", "--g2-capacity-bytes", "--g3-dir", "--metrics-addr", "config"] {
        assert!(text.contains(flag), "--help lacks {flag}:\n{text}");
    }
    let out = Command::new(bin).args(["--g3-capacity-bytes", "12345", "config"]).output().unwrap();
    assert!(out.status.success());
    let toml = String::from_utf8_lossy(&out.stdout);
    assert!(toml.contains("capacity_bytes = 12345"), "{toml}");
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("bad.toml");
    std::fs::write(&f, "[g2]\npage_size = 1000\n").unwrap();
    let out = Command::new(bin).args(["--config", f.to_str().unwrap(), "config"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("g2.page_size"), "{err}");
    let out = Command::new(bin).env("KVCACHED_G3_IO_BACKEND", "spdk").arg("config").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("g3.io_backend"));
}

/// One check for `config` and `run`: every inconsistent combination exits 2 naming its field,
/// and `run` says nothing about listening or serving first (nothing is bound).
#[test]
fn config_and_run_refuse_the_same_combinations_before_anything_starts() {
    let bin = env!("CARGO_BIN_EXE_kvcached");
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("k.sock");
    for (name, toml, field) in [
        ("metrics off loopback", "metrics_addr = \"0.0.0.0:0\"\n", "metrics_auth"),
        ("tcp off loopback", "tcp = \"0.0.0.0:0\"\n", "tcp_auth"),
        ("tcp_auth without tcp", "[tcp_auth]\nopen = true\n", "tcp_auth"),
        ("g4 url without enabled", "[g4]\nurl = \"s3://bucket/p\"\n", "g4.enabled"),
        ("advertise without listen", "[peer]\nadvertise = \"10.0.0.1:7471\"\n", "peer.listen"),
        ("peer auth without listen", "[peer.auth]\nopen = true\n", "peer.listen"),
        ("peer listen without credentials", "[peer]\nlisten = \"127.0.0.1:0\"\n", "peer.auth"),
    ] {
        let f = d.path().join("c.toml");
        std::fs::write(&f, toml).unwrap();
        for cmd in ["config", "run"] {
            let out = Command::new(bin)
                .args(["--config", f.to_str().unwrap(), "--socket", sock.to_str().unwrap(), cmd])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{name} ({cmd}): {err}");
            assert!(err.contains(&format!("invalid configuration: {field}")), "{name} ({cmd}): {err}");
            assert!(!err.contains("listening") && !err.contains("serving"), "{name} ({cmd}) announced: {err}");
            assert!(!sock.exists(), "{name} ({cmd}) bound its socket");
        }
    }
    // Open on purpose is accepted.
    let f = d.path().join("ok.toml");
    std::fs::write(&f, "metrics_addr = \"0.0.0.0:0\"\n[metrics_auth]\nopen = true\n").unwrap();
    let out = Command::new(bin).args(["--config", f.to_str().unwrap(), "config"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// G3's automatic capacity is fixed by the data file of the first start: a later start keeps
/// that size (and says so) whatever the free space is then.
#[test]
fn g3_automatic_capacity_is_kept_from_the_data_file() {
    let bin = env!("CARGO_BIN_EXE_kvcached");
    let d = tempfile::tempdir().unwrap();
    let g3 = d.path().join("g3");
    std::fs::create_dir_all(&g3).unwrap();
    let file = std::fs::File::create(g3.join("blocks.dat")).unwrap();
    file.set_len(96 << 20).unwrap();
    let out =
        Command::new(bin).args(["--g3-dir", g3.to_str().unwrap(), "--g3-enabled", "true", "config"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let toml = String::from_utf8_lossy(&out.stdout);
    assert!(toml.contains(&format!("capacity_bytes = {}", 96u64 << 20)), "{toml}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("G3 capacity kept from the data file"));
}
