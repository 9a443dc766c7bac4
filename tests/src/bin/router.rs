//! The `kvrouter` router, built in this package so its tests can start it as a process.

fn main() -> std::process::ExitCode {
    kvrouter::cli::main()
}
