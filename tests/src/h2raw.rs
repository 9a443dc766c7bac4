//! HTTP/2 frames written by hand, for tests that send what no gRPC client would: requests that
//! never finish, bodies larger than they say, malformed messages.

/// The connection preface and an empty SETTINGS frame.
pub fn preface() -> Vec<u8> {
    let mut f = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    f.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    f
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The HEADERS of a gRPC call to `path` on `stream` (literal header fields, no Huffman).
pub fn grpc_headers(stream: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    for (index, value) in [(0x44u8, path.as_bytes()), (0x41, b"localhost"), (0x5f, b"application/grpc")] {
        block.push(index); // literal with incremental indexing, indexed name
        block.push(value.len() as u8);
        block.extend_from_slice(value);
    }
    frame(1, 0x4, stream, &block) // END_HEADERS
}

/// A DATA frame on `stream` (`end`: END_STREAM). At most 16 KiB (the default frame size).
pub fn data(stream: u32, payload: &[u8], end: bool) -> Vec<u8> {
    frame(0, u8::from(end), stream, payload)
}

/// The 5-byte gRPC message prefix announcing `len` bytes.
pub fn grpc_prefix(len: u32) -> Vec<u8> {
    let mut p = vec![0];
    p.extend_from_slice(&len.to_be_bytes());
    p
}

/// Sends the preface, reads frames until the server's SETTINGS (acknowledged: the server's
/// stream windows apply only from then on) and its WINDOW_UPDATE of the connection. The daemon
/// raises its connection window from HTTP/2's 65,535 bytes with that update; DATA sent before it
/// arrives may pass the initial window, which the daemon answers by closing the connection.
pub async fn handshake<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(s: &mut S) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(&preface()).await?;
    let (mut settings, mut window) = (false, false);
    while !(settings && window) {
        let mut head = [0u8; 9];
        s.read_exact(&mut head).await?;
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await?;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        match head[3] {
            4 if head[4] & 1 == 0 => {
                s.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await?;
                settings = true;
            }
            8 if stream == 0 => window = true,
            _ => {}
        }
    }
    Ok(())
}
