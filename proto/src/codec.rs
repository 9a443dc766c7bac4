//! The gRPC codec of the generated services: prost's, except that a message that does not
//! decode is the caller's error (`INVALID_ARGUMENT`, "malformed request"), not the server's
//! (`tonic_prost` answers `INTERNAL`).

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};

/// Prost encoding and decoding; decode errors are `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct KvCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for KvCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for KvCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = KvDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        KvDecoder(PhantomData)
    }
}

/// Decodes a prost message; a malformed one is `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct KvDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for KvDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Rewrites tonic's answers to request bodies that hold no whole message ("Missing request
/// message.", "Unexpected EOF decoding stream.": INTERNAL) into INVALID_ARGUMENT, the caller's
/// error like any other malformed request (found by `tests/fuzz_router.rs`). The INTERNAL that
/// gRPC's specification prescribes for a compressed flag without an encoding stays.
pub fn truncated_request_is_invalid(headers: &mut tonic::codegen::http::HeaderMap) {
    use tonic::codegen::http::HeaderValue;
    let truncated = headers.get("grpc-status").is_some_and(|s| s == "13")
        && headers
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| m.starts_with("Missing%20request%20message") || m.starts_with("Unexpected%20EOF"));
    if truncated {
        headers.insert("grpc-status", HeaderValue::from_static("3"));
        headers.insert("grpc-message", HeaderValue::from_static("malformed%20request:%20no%20whole%20message"));
    }
}
