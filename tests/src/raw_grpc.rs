//! The daemon's gRPC API over its Unix socket through the generated client, and raw bytes as a
//! request body: for requests the client crate never would send.

use std::path::Path;

use kvproto::pb;
use prost::bytes::{Buf, BufMut};
use tonic::transport::Channel;

/// A gRPC channel to the daemon listening on `socket`.
pub async fn unix_channel(socket: &Path) -> Channel {
    let socket = socket.to_path_buf();
    tonic::transport::Endpoint::try_from("http://kvcached.local")
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move { tokio::net::UnixStream::connect(socket).await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The generated gRPC client over the daemon's Unix socket.
pub async fn raw_client(socket: &Path) -> pb::kvcached_client::KvcachedClient<Channel> {
    pb::kvcached_client::KvcachedClient::new(unix_channel(socket).await)
}

/// Sends `body` as the message of `method` (a path such as `/kvcached.v1.Kvcached/Register`) on
/// a new channel to `socket`; the answer's message is dropped unread.
pub async fn raw_unary(socket: &Path, method: &'static str, body: Vec<u8>) -> Result<(), tonic::Status> {
    let mut g = tonic::client::Grpc::new(unix_channel(socket).await);
    g.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    g.unary(tonic::Request::new(body), tonic::codegen::http::uri::PathAndQuery::from_static(method), RawCodec)
        .await
        .map(drop)
}

/// Sends raw bytes as a gRPC message; the answer is decoded as nothing.
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = ();
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = ();
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<()>, tonic::Status> {
        src.advance(src.remaining());
        Ok(Some(()))
    }
}
