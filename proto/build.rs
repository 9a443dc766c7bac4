//! Generates the gRPC code of `proto/kvcached.proto` with a vendored protoc (no system protoc
//! needed), when the `grpc` feature is on.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "grpc")]
    generate()?;
    Ok(())
}

#[cfg(feature = "grpc")]
fn generate() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=proto/kvcached.proto");
    // Token fields decode as `Bytes` (a slice of the receive buffer, no copy).
    tonic_prost_build::configure()
        .codec_path("crate::codec::KvCodec")
        .bytes(".kvcached.v1.SaveRequest.tokens")
        .bytes(".kvcached.v1.LookupRequest.tokens")
        .bytes(".kvcached.v1.LoadRequest.tokens")
        .bytes(".kvcached.v1.GpuBlocksRequest.tokens")
        .compile_protos(&["proto/kvcached.proto"], &["proto"])?;
    Ok(())
}
