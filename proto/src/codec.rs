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
