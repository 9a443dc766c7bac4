//! Generates the gRPC code of `router/proto/kvrouter.proto` with a vendored protoc (no system
//! protoc needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=proto/kvrouter.proto");
    // kvproto's codec: a body that is not the message is the caller's error (INVALID_ARGUMENT),
    // not the router's (tonic_prost's INTERNAL; found by tests/fuzz_router.rs).
    tonic_prost_build::configure()
        .codec_path("kvproto::codec::KvCodec")
        .compile_protos(&["proto/kvrouter.proto"], &["proto"])?;
    Ok(())
}
