//! The `kvcached` daemon, built in this package so its tests can start it as a process.

fn main() -> std::process::ExitCode {
    kvcached::cli::main()
}
