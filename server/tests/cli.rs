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
