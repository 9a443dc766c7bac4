//! Stock gRPC clients over a Unix socket: grpcio (C-core) sends the socket's path, percent-
//! encoded, as the HTTP/2 `:authority` (`tmp%2Fkvcached.sock`), which the daemon's HTTP/2 stack
//! refuses (a `%` outside userinfo is not a valid host), so every call failed with "Stream
//! removed". On the Unix socket the authority means nothing, so the daemon reads client header
//! blocks through [`HeaderFix`]. The first block decides: when its `:authority` is usable (every
//! Rust client, and grpcio given `grpc.default_authority`) it goes on as it came and the rest of
//! the connection passes through untouched, at no cost. Otherwise each block is decoded (HPACK,
//! with the client's dynamic table) and passed on as literal fields that never touch the
//! server's dynamic table, with the unusable `:authority` replaced by `localhost`; every other
//! frame passes through untouched, and DATA frames' payloads without a copy.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

use crate::edge::passthrough::{Passthrough, ReadSide, SameConnection};

const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Largest header block collected (the server's own limit is 64 KiB of decoded headers).
const MAX_BLOCK: usize = 256 << 10;
/// Frames re-emitted are at most this long (the HTTP/2 default every peer accepts).
const OUT_FRAME: usize = 16 << 10;
/// Most bytes of decoded header fields one block may expand to (the server's own header-list
/// limit, `http2_max_header_list_size`): a block of references to one large table entry cannot
/// make the daemon hold more. Past it the connection fails, as the server would fail it.
const MAX_DECODED: usize = 64 << 10;
/// The HPACK dynamic table size the server announces (the default; it never raises it).
const TABLE_SIZE: usize = 4096;

/// Where the reader is in the client's byte stream.
#[derive(Debug)]
enum State {
    /// Passing the connection preface through (bytes left).
    Preface(usize),
    /// Collecting a frame header.
    Header,
    /// Passing a frame's payload through (bytes left).
    Payload(usize),
    /// Collecting a HEADERS or CONTINUATION payload (bytes left).
    Block(usize),
}

/// A client connection whose request header blocks are rewritten (see the module docs).
pub type HeaderFix<IO> = Passthrough<IO, HeaderRewrite>;

/// The reader of a [`HeaderFix`]: where it is in the client's byte stream, and what it has
/// rewritten but not yet handed over.
pub struct HeaderRewrite {
    state: State,
    head: Vec<u8>,
    /// The header block being collected: (stream, END_STREAM, fragments so far).
    block: Option<(u32, bool, Vec<u8>)>,
    /// Bytes ready for the server, not yet handed over.
    out: Vec<u8>,
    out_at: usize,
    decoder: loona_hpack::Decoder<'static>,
    mode: Mode,
    /// While [`Mode::Deciding`]: the first header block's frames as they came.
    raw: Vec<u8>,
}

/// What the reader does with the client's header blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The first block is being collected.
    Deciding,
    /// Every block is decoded and passed on rewritten.
    Rewriting,
    /// Everything passes through untouched: the first block's authority was usable, or a block
    /// could not be decoded (the server's own decoder then fails the connection, as it would
    /// have without this reader).
    Passthrough,
}

impl std::fmt::Debug for HeaderRewrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderRewrite").field("state", &self.state).finish_non_exhaustive()
    }
}

impl<IO> HeaderFix<IO> {
    pub fn new(io: IO) -> Self {
        Self { io, side: HeaderRewrite::new() }
    }
}

impl Default for HeaderRewrite {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderRewrite {
    pub fn new() -> Self {
        Self {
            state: State::Preface(PREFACE_LEN),
            head: Vec::with_capacity(FRAME_HEADER),
            block: None,
            out: Vec::new(),
            out_at: 0,
            decoder: {
                let mut d = loona_hpack::Decoder::new();
                d.set_max_allowed_table_size(TABLE_SIZE);
                d
            },
            mode: Mode::Deciding,
            raw: Vec::new(),
        }
    }

    /// Consumes bytes read from the client (not DATA payloads, which pass straight through).
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.mode == Mode::Passthrough {
                self.out.extend_from_slice(bytes);
                return;
            }
            match self.state {
                State::Preface(left) | State::Payload(left) => {
                    let n = left.min(bytes.len());
                    self.out.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    self.state = match (&self.state, left - n) {
                        (_, 0) => State::Header,
                        (State::Preface(_), l) => State::Preface(l),
                        (_, l) => State::Payload(l),
                    };
                }
                State::Header => {
                    let n = (FRAME_HEADER - self.head.len()).min(bytes.len());
                    self.head.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    if self.head.len() == FRAME_HEADER {
                        self.frame_header();
                    }
                }
                State::Block(left) => {
                    let n = left.min(bytes.len());
                    if self.mode == Mode::Deciding {
                        self.raw.extend_from_slice(&bytes[..n]);
                    }
                    if let Some((_, _, b)) = self.block.as_mut() {
                        b.extend_from_slice(&bytes[..n]);
                    }
                    bytes = &bytes[n..];
                    self.state = if left == n { State::Header } else { State::Block(left - n) };
                    if left == n {
                        self.fragment_done();
                    }
                }
            }
        }
    }

    /// A frame header is complete: pass it on, or start collecting a header block.
    fn frame_header(&mut self) {
        let h = std::mem::take(&mut self.head);
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let collecting = kind == HEADERS || (kind == CONTINUATION && self.block.is_some());
        if !collecting {
            self.out.extend_from_slice(&h);
            self.state = if len == 0 { State::Header } else { State::Payload(len) };
            return;
        }
        if kind == HEADERS {
            self.block = Some((stream, flags & END_STREAM != 0, Vec::with_capacity(len)));
        }
        if self.mode == Mode::Deciding {
            self.raw.extend_from_slice(&h);
        }
        self.head = h; // kept for `fragment_done` (flags, padding)
        self.state = State::Block(len);
        if len == 0 {
            self.state = State::Header;
            self.fragment_done();
        }
    }

    /// A HEADERS or CONTINUATION payload is in: strip padding and priority, and at END_HEADERS
    /// decode the block and emit it rewritten.
    fn fragment_done(&mut self) {
        let h = std::mem::take(&mut self.head);
        let (kind, flags) = (h[3], h[4]);
        let Some((stream, end_stream, mut block)) = self.block.take() else { return };
        let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
        if kind == HEADERS {
            // This fragment is the whole block so far.
            let mut frag = std::mem::take(&mut block);
            let mut start = 0;
            let mut end = frag.len();
            if flags & PADDED != 0 && !frag.is_empty() {
                let pad = usize::from(frag[0]);
                start = 1;
                end = end.saturating_sub(pad);
            }
            if flags & PRIORITY != 0 {
                start += 5;
            }
            if start > end || end > len {
                return self.fail();
            }
            frag.truncate(end);
            block = frag.split_off(start);
        }
        if block.len() > MAX_BLOCK {
            return self.fail();
        }
        if flags & END_HEADERS == 0 {
            self.block = Some((stream, end_stream, block));
            return;
        }
        // Decoded with a bound on what the block expands to (each field counted as its name, its
        // value and 32 bytes, as HTTP/2 counts a header list).
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut decoded = 0usize;
        let mut over = false;
        let r = self.decoder.decode_with_cb(&block, |n, v| {
            decoded += n.len() + v.len() + 32;
            if decoded > MAX_DECODED {
                over = true;
            } else {
                fields.push((n.into_owned(), v.into_owned()));
            }
        });
        match r {
            Ok(()) if !over => {
                let usable = fields.iter().all(|(n, v)| n != b":authority" || valid_authority(v));
                if self.mode == Mode::Deciding && usable {
                    // The server decodes the original bytes with the client's table: from here
                    // on the two stay in step without this reader.
                    self.out.append(&mut self.raw);
                    self.mode = Mode::Passthrough;
                    return;
                }
                self.mode = Mode::Rewriting;
                self.raw = Vec::new();
                self.emit(stream, end_stream, &fields);
            }
            _ => self.fail(),
        }
    }

    /// From now on everything passes through untouched (the first block as it came, if it was
    /// the first): the server's own HPACK decoder then fails on the connection and closes it, as
    /// it would have without this reader.
    fn fail(&mut self) {
        if self.mode == Mode::Deciding {
            self.out.append(&mut self.raw);
        }
        self.mode = Mode::Passthrough;
        self.block = None;
    }

    fn emit(&mut self, stream: u32, end_stream: bool, fields: &[(Vec<u8>, Vec<u8>)]) {
        let mut block = Vec::new();
        for (name, value) in fields {
            let value: &[u8] = if name == b":authority" && !valid_authority(value) { b"localhost" } else { value };
            // Literal header field without indexing, new name (RFC 7541 6.2.2): the server's
            // dynamic table is never used.
            block.push(0x00);
            put_string(&mut block, name);
            put_string(&mut block, value);
        }
        let mut chunks = block.chunks(OUT_FRAME).peekable();
        let mut first = true;
        if block.is_empty() {
            let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
            self.put_frame(HEADERS, flags, stream, &[]);
            return;
        }
        while let Some(c) = chunks.next() {
            let last = chunks.peek().is_none();
            let mut flags = if last { END_HEADERS } else { 0 };
            if first && end_stream {
                flags |= END_STREAM;
            }
            self.put_frame(if first { HEADERS } else { CONTINUATION }, flags, stream, c);
            first = false;
        }
    }

    fn put_frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len();
        self.out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        self.out.extend_from_slice(&stream.to_be_bytes());
        self.out.extend_from_slice(payload);
    }
}

fn valid_authority(v: &[u8]) -> bool {
    http::uri::Authority::try_from(v).is_ok()
}

/// An HPACK string literal without Huffman coding.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    put_int(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 5.1).
fn put_int(out: &mut Vec<u8>, mut v: usize, n: u8, first: u8) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128 + 128) as u8);
        v /= 128;
    }
    out.push(v as u8);
}

impl SameConnection for HeaderRewrite {}

impl<IO: AsyncRead + Unpin> ReadSide<IO> for HeaderRewrite {
    fn poll_read(&mut self, io: &mut IO, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self;
        loop {
            if this.out_at < this.out.len() {
                let n = (this.out.len() - this.out_at).min(buf.remaining());
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                    if this.mode == Mode::Passthrough {
                        this.out = Vec::new(); // its buffer is not needed again
                    }
                }
                return Poll::Ready(Ok(()));
            }
            if this.mode == Mode::Passthrough {
                return Pin::new(&mut *io).poll_read(cx, buf);
            }
            // A DATA (or any non-header) payload: straight into the caller's buffer.
            if let State::Payload(left) = this.state {
                let before = buf.filled().len();
                let limit = left.min(buf.remaining());
                let mut sub = buf.take(limit);
                match Pin::new(&mut *io).poll_read(cx, &mut sub) {
                    Poll::Ready(Ok(())) => {
                        let n = sub.filled().len();
                        // SAFETY: `sub` wrote `n` initialised bytes into `buf`'s unfilled part.
                        unsafe { buf.assume_init(n) };
                        buf.advance(n);
                        if n == 0 {
                            return Poll::Ready(Ok(())); // EOF
                        }
                        this.state = if left == n { State::Header } else { State::Payload(left - n) };
                        debug_assert_eq!(buf.filled().len(), before + n);
                        return Poll::Ready(Ok(()));
                    }
                    other => return other,
                }
            }
            let mut tmp = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut *io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    if n == 0 {
                        return Poll::Ready(Ok(())); // EOF
                    }
                    this.feed(&tmp[..n]);
                }
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Feeds `input` a byte at a time and in one piece; both give the same output.
    fn run(input: &[u8]) -> Vec<u8> {
        let mut whole = HeaderRewrite::new();
        whole.feed(input);
        let mut bytewise = HeaderRewrite::new();
        for b in input {
            bytewise.feed(std::slice::from_ref(b));
        }
        assert_eq!(whole.out, bytewise.out);
        whole.out
    }

    /// A grpcio-style block (Huffman strings, dynamic-table references on the second request),
    /// split over HEADERS with padding and priority plus a CONTINUATION, comes out as literal
    /// fields with a usable authority; DATA and other frames pass unchanged.
    #[test]
    fn header_blocks_are_rewritten_and_other_frames_pass() {
        let mut enc = loona_hpack::Encoder::new();
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":path", b"/kvcached.v1.Kvcached/Health"),
            (b":authority", b"tmp%2Fgp%2Fk.sock"),
            (b"content-type", b"application/grpc"),
        ];
        let block1 = enc.encode(headers.iter().copied());
        let block2 = enc.encode(headers.iter().copied()); // indexed from the dynamic table
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(4, 0, 0, &[])); // SETTINGS
        let (a, b) = block1.split_at(block1.len() / 2);
        let mut first = vec![2u8]; // pad length
        first.extend_from_slice(&[0, 0, 0, 0, 16]); // priority
        first.extend_from_slice(a);
        first.extend_from_slice(&[0, 0]); // padding
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &first));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0, END_STREAM, 1, b"\0\0\0\0\0"));
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &block2));
        let out = run(&input);
        assert_eq!(out[..PREFACE_LEN + 9], input[..PREFACE_LEN + 9]);
        // Decode what the server sees with a fresh decoder: both blocks decode alone.
        let mut dec = loona_hpack::Decoder::new();
        let mut at = PREFACE_LEN + 9;
        let mut seen = Vec::new();
        while at < out.len() {
            let len = (usize::from(out[at]) << 16) | (usize::from(out[at + 1]) << 8) | usize::from(out[at + 2]);
            let (kind, flags) = (out[at + 3], out[at + 4]);
            let payload = &out[at + 9..at + 9 + len];
            seen.push((kind, flags));
            if kind == HEADERS {
                let fields = dec.decode(payload).unwrap();
                let authority = fields.iter().find(|(n, _)| n == b":authority").unwrap();
                assert_eq!(authority.1, b"localhost");
                assert_eq!(fields.len(), 4);
            }
            at += 9 + len;
        }
        assert_eq!(seen, vec![(HEADERS, END_HEADERS), (0, END_STREAM), (HEADERS, END_HEADERS | END_STREAM)]);
        assert!(dec.decode(&[0x80 | 62]).is_err(), "the server's dynamic table stays empty");
    }

    /// A small block of references to one large table entry would expand to gigabytes: decoding
    /// stops at the bound and the block passes on untouched (the server then fails the
    /// connection, as it would without this reader).
    #[test]
    fn a_block_that_expands_past_the_bound_is_not_decoded() {
        let mut block = vec![0x40, 0x01, b'x', 0x7f]; // literal with indexing, name "x", value...
        block.push(0xa1); // ...length 4000: 127 + 3873 as an HPACK integer (33 + 128, 30)
        block.push(0x1e);
        block.extend(std::iter::repeat_n(b'v', 4000));
        block.extend(std::iter::repeat_n(0x80 | 62, 10_000)); // 10,000 references to it
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let mut fix = HeaderRewrite::new();
        fix.feed(&input);
        assert_eq!(fix.mode, Mode::Passthrough);
        assert!(fix.out.len() < block.len() + 100, "nothing expanded: {} bytes out", fix.out.len());
    }

    #[test]
    fn a_valid_authority_is_kept_and_garbage_passes_through() {
        let mut enc = loona_hpack::Encoder::new();
        let block = enc.encode(vec![(&b":authority"[..], &b"localhost:50051"[..])]);
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        // A usable first block: the connection passes through as it came, later blocks (which
        // refer to the client's dynamic table) included.
        let later = enc.encode(vec![(&b":authority"[..], &b"localhost:50051"[..])]);
        input.extend(frame(0, 0, 1, b"abc"));
        input.extend(frame(HEADERS, END_HEADERS, 3, &later));
        assert_eq!(run(&input), input);
        // An undecodable block: passed on as it is (the server then refuses the connection).
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]));
        input.extend(frame(0, 0, 1, b"abc"));
        let out = run(&input);
        assert!(out.ends_with(&frame(0, 0, 1, b"abc")));
    }
}
