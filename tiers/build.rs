//! Stops a build early, with the command that fixes it, when RocksDB's prebuilt library is not
//! where `.cargo/config.toml` says (the link `.rocksdb`, made by `scripts/run` / `scripts/test`):
//! without this the build fails only at the final link, with "could not find native static
//! library `rocksdb`".

fn main() {
    println!("cargo:rerun-if-env-changed=ROCKSDB_LIB_DIR");
    println!("cargo:rerun-if-env-changed=ROCKSDB_COMPILE");
    let Some(dir) = std::env::var_os("ROCKSDB_LIB_DIR") else { return };
    let compile = std::env::var("ROCKSDB_COMPILE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let lib = std::path::Path::new(&dir).join("librocksdb.a");
    println!("cargo:rerun-if-changed={}", lib.display());
    if !compile && !lib.is_file() {
        panic!(
            "\n\nRocksDB's library is not built yet ({} is missing).\n\
             Run `scripts/run` or `scripts/test` once: they build it into ~/.cache/kvcached and link it \
             (or set ROCKSDB_COMPILE=1 to compile RocksDB inside this build, ~9 minutes per profile).\n",
            lib.display()
        );
    }
}
