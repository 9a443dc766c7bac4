//! LOOKUP, a connection that carries only lookups (proto/kvcached.proto, LOOKUP): length-framed
//! `LookupRequest` / `LookupResponse` messages on the daemon's Unix socket, without HTTP/2.
//!
//! A lookup is on the path of every request an engine serves, and its work in the daemon is
//! tens of microseconds; over gRPC the round trip itself cost several times that (HTTP/2 and
//! tonic on both sides, and the tasks and threads they hand the call between). Only the bytes
//! are here; the client and the daemon frame and parse them.
//!
//! The exchange:
//! - client, once: [`HELLO_BYTES`] bytes, `"KVLK" VERSION 0 0 0`;
//! - daemon, once: the same 8 bytes when it serves LOOKUP. A daemon that does not (an older one,
//!   or one with `engines.lookup_wire = false`) treats the bytes as a broken HTTP/2 preface: it
//!   sends HTTP/2's SETTINGS and closes the connection. Any answer but the hello means LOOKUP is
//!   not served, and the client looks up over gRPC;
//! - then, one at a time: a request, `len: u32 LE` and `len` bytes of `LookupRequest`; an answer,
//!   `len: u32 LE`, then `len` bytes: a status byte, [`OK`] followed by a `LookupResponse`, or
//!   [`REFUSED`] followed by the refusal ([`refusal`]).
//!
//! A request longer than the daemon's `limits.max_message_bytes` is refused from its length
//! (`OUT_OF_RANGE`, as gRPC refuses one), one the uid's buffered bytes cannot take is refused
//! (`RESOURCE_EXHAUSTED`), one that does not decode is refused (`INVALID_ARGUMENT`); each closes
//! the connection. A request not read and answered within `limits.request_timeout_ms` (a client
//! that does not read its answers) closes it too.

/// The first bytes of a LOOKUP connection (an HTTP/2 connection starts with `PRI `).
pub const MAGIC: [u8; 4] = *b"KVLK";
/// The version of the exchange.
pub const VERSION: u8 = 1;
/// Bytes of the hello each side sends once.
pub const HELLO_BYTES: usize = 8;
/// Status byte of an answer carrying a `LookupResponse`.
pub const OK: u8 = 0;
/// Status byte of an answer carrying a refusal.
pub const REFUSED: u8 = 1;
/// Longest message a refusal carries.
pub const MAX_MESSAGE_BYTES: usize = 4096;
/// Longest answer a client reads: a `LookupResponse` is a few numbers and a tier list.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The hello both sides send.
pub fn hello() -> [u8; HELLO_BYTES] {
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, 0, 0, 0]
}

/// Checks a hello: Ok, or why it is not one this side speaks.
pub fn check_hello(h: &[u8; HELLO_BYTES]) -> Result<(), String> {
    if h[..4] != MAGIC {
        return Err("not a LOOKUP hello".into());
    }
    if h[4] != VERSION {
        return Err(format!("LOOKUP version {} is not supported (this side speaks {VERSION})", h[4]));
    }
    Ok(())
}

/// The start of a request frame for a `LookupRequest` of `len` bytes, with room for it: the
/// message is encoded straight after.
pub fn request_frame(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out
}

/// The start of an answer frame for a `LookupResponse` of `len` bytes, with room for it.
pub fn answer_frame(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + len);
    out.extend_from_slice(&(len as u32 + 1).to_le_bytes());
    out.push(OK);
    out
}

/// The frame of a request whose encoded `LookupRequest` is `message`.
pub fn request(message: &[u8]) -> Vec<u8> {
    let mut out = request_frame(message.len());
    out.extend_from_slice(message);
    out
}

/// The frame of an answer carrying an encoded `LookupResponse`.
pub fn answer(message: &[u8]) -> Vec<u8> {
    let mut out = answer_frame(message.len());
    out.extend_from_slice(message);
    out
}

/// A refused lookup: the gRPC status code it would have had, the reason's name
/// ([`crate::reason::Reason::name`]; empty for none), and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: i32,
    pub reason: String,
    pub message: String,
}

/// The frame of an answer carrying `r`: `code: i32 LE`, `reason_len: u8`, the reason, then the
/// message (clipped to [`MAX_MESSAGE_BYTES`]), all UTF-8.
pub fn refusal(r: &Refusal) -> Vec<u8> {
    let reason = crate::limits::clip(&r.reason, 255);
    let message = crate::limits::clip(&r.message, MAX_MESSAGE_BYTES);
    let body = 1 + 4 + 1 + reason.len() + message.len();
    let mut out = Vec::with_capacity(4 + body);
    out.extend_from_slice(&(body as u32).to_le_bytes());
    out.push(REFUSED);
    out.extend_from_slice(&r.code.to_le_bytes());
    out.push(reason.len() as u8);
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// An answer's body (after its length): the encoded `LookupResponse`, or the refusal.
pub fn parse_answer(body: &[u8]) -> Result<Result<&[u8], Refusal>, String> {
    match body.split_first() {
        Some((&OK, message)) => Ok(Ok(message)),
        Some((&REFUSED, rest)) => {
            let (code, rest) = rest.split_first_chunk::<4>().ok_or("a LOOKUP refusal without its code")?;
            let (&n, rest) = rest.split_first().ok_or("a LOOKUP refusal without its reason")?;
            if rest.len() < usize::from(n) {
                return Err("a LOOKUP refusal shorter than its reason".into());
            }
            let (reason, message) = rest.split_at(usize::from(n));
            Ok(Err(Refusal {
                code: i32::from_le_bytes(*code),
                reason: String::from_utf8_lossy(reason).into_owned(),
                message: String::from_utf8_lossy(message).into_owned(),
            }))
        }
        Some((s, _)) => Err(format!("a LOOKUP answer with status {s}")),
        None => Err("an empty LOOKUP answer".into()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_other_versions_are_named() {
        assert_eq!(check_hello(&hello()), Ok(()));
        let mut h = hello();
        h[4] = 9;
        assert!(check_hello(&h).unwrap_err().contains("version 9"));
        assert!(check_hello(b"PRI * HT").is_err());
    }

    #[test]
    fn answers_and_refusals_parse_back() {
        let a = answer(b"abc");
        assert_eq!(u32::from_le_bytes(a[..4].try_into().unwrap()) as usize, a.len() - 4);
        assert_eq!(parse_answer(&a[4..]), Ok(Ok(&b"abc"[..])));
        let r = Refusal { code: 5, reason: "unknown-engine".into(), message: "engine 7 is not registered".into() };
        let f = refusal(&r);
        assert_eq!(u32::from_le_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
        assert_eq!(parse_answer(&f[4..]), Ok(Err(r)));
        let long = Refusal { code: 3, reason: String::new(), message: "x".repeat(10 * MAX_MESSAGE_BYTES) };
        let Ok(Err(back)) = parse_answer(&refusal(&long)[4..]) else { panic!("a refusal") };
        assert!(back.message.len() <= MAX_MESSAGE_BYTES && back.reason.is_empty());
    }

    #[test]
    fn broken_answers_are_errors_not_panics() {
        for body in [&[][..], &[2][..], &[REFUSED][..], &[REFUSED, 1, 0, 0][..], &[REFUSED, 1, 0, 0, 0, 9, b'a'][..]] {
            assert!(parse_answer(body).is_err(), "{body:?}");
        }
    }
}
