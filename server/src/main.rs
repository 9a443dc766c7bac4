//! `kvcached`, the per-node daemon: everything is in the library ([`kvcached::cli`]).

fn main() -> std::process::ExitCode {
    kvcached::cli::main()
}
