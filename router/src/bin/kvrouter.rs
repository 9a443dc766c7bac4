//! `kvrouter`, the cluster router: everything is in the library ([`kvrouter::cli`]).

fn main() -> std::process::ExitCode {
    kvrouter::cli::main()
}
