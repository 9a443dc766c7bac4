//! LOOKUP ([`kvproto::lookup_wire`]) by hand: a connection that said hello, requests framed as
//! told (also broken ones), and the daemon's answers read back.

use kvproto::lookup_wire::{self, HELLO_BYTES, Refusal};
use kvproto::pb;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A connection to `socket` whose hello the daemon answered.
pub async fn open(socket: &std::path::Path) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(socket).await?;
    s.write_all(&lookup_wire::hello()).await?;
    let mut hello = [0u8; HELLO_BYTES];
    s.read_exact(&mut hello).await?;
    lookup_wire::check_hello(&hello).map_err(std::io::Error::other)?;
    Ok(s)
}

/// The daemon's next answer: a response, or a refusal.
pub async fn answer(s: &mut UnixStream) -> std::io::Result<Result<pb::LookupResponse, Refusal>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).await?;
    match lookup_wire::parse_answer(&body).map_err(std::io::Error::other)? {
        Ok(m) => pb::LookupResponse::decode(m).map(Ok).map_err(std::io::Error::other),
        Err(r) => Ok(Err(r)),
    }
}

/// `req` asked on `s`.
pub async fn ask(s: &mut UnixStream, req: &pb::LookupRequest) -> std::io::Result<Result<pb::LookupResponse, Refusal>> {
    s.write_all(&lookup_wire::request(&req.encode_to_vec())).await?;
    answer(s).await
}

/// Whether the daemon closed `s` (reads end) within `within`.
pub async fn closed(s: &mut UnixStream, within: std::time::Duration) -> bool {
    let mut buf = [0u8; 256];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}
