//! Generates the gRPC code of `router/proto/kvrouter.proto` with a vendored protoc (no system
//! protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=proto/kvrouter.proto");
    tonic_prost_build::configure().compile_protos(&["proto/kvrouter.proto"], &["proto"])?;
    Ok(())
}
