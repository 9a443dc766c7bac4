//! ATTACH, the exchange that hands file descriptors (an engine's KV memory, its token area) to
//! the daemon over its Unix socket (proto/kvcached.proto, ATTACH). Only the bytes are here; the
//! client sends them with `sendmsg` and `SCM_RIGHTS`, the daemon answers with tickets that a
//! Register redeems.

/// The first bytes of an ATTACH connection (an HTTP/2 connection starts with `PRI `).
pub const MAGIC: [u8; 4] = *b"KVFD";
/// The version of the exchange.
pub const VERSION: u8 = 1;
/// Descriptors one exchange may carry.
pub const MAX_FDS: usize = 4;
/// Bytes of a request (and of a reply's fixed part).
pub const HEADER_BYTES: usize = 8;
/// Bytes of a ticket.
pub const TICKET_BYTES: usize = 16;
/// How long a ticket stays redeemable.
pub const TICKET_TTL_MS: u64 = 30_000;
/// Longest reason a refusal carries.
pub const MAX_REASON_BYTES: usize = 512;

/// A ticket for one passed descriptor.
pub type Ticket = [u8; TICKET_BYTES];

/// The request header for `nfds` descriptors.
pub fn request(nfds: usize) -> [u8; HEADER_BYTES] {
    let n = nfds.min(MAX_FDS) as u8;
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, n, 0, 0]
}

/// Parses a request header: the number of descriptors it announces.
pub fn parse_request(h: &[u8; HEADER_BYTES]) -> Result<usize, String> {
    if h[..4] != MAGIC {
        return Err("not an ATTACH request".into());
    }
    if h[4] != VERSION {
        return Err(format!("ATTACH version {} is not supported (this daemon speaks {VERSION})", h[4]));
    }
    let n = usize::from(h[5]);
    if n == 0 || n > MAX_FDS {
        return Err(format!("ATTACH announces {n} descriptors: send 1 to {MAX_FDS}"));
    }
    Ok(n)
}

/// A reply granting `tickets`.
pub fn granted(tickets: &[Ticket]) -> Vec<u8> {
    let mut out = vec![MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, 0, 0, 0];
    for t in tickets {
        out.extend_from_slice(t);
    }
    out
}

/// A reply refusing the exchange because of `why` (clipped to [`MAX_REASON_BYTES`]).
pub fn refused(why: &str) -> Vec<u8> {
    let why = crate::limits::clip(why, MAX_REASON_BYTES);
    let len = (why.len() as u16).to_le_bytes();
    let mut out = vec![MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], VERSION, 1, len[0], len[1]];
    out.extend_from_slice(why.as_bytes());
    out
}

/// What a reply's header says: `Ok(())` when tickets follow, else the length of the reason.
pub fn parse_reply(h: &[u8; HEADER_BYTES]) -> Result<Result<(), usize>, String> {
    if h[..4] != MAGIC || h[4] != VERSION {
        return Err("the daemon's answer is not an ATTACH reply (an older kvcached?)".into());
    }
    match h[5] {
        0 => Ok(Ok(())),
        1 => Ok(Err(usize::from(u16::from_le_bytes([h[6], h[7]])))),
        s => Err(format!("unknown ATTACH status {s}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip() {
        assert_eq!(parse_request(&request(2)), Ok(2));
        let mut h = request(2);
        h[5] = 0;
        assert!(parse_request(&h).is_err());
        h[5] = 5;
        assert!(parse_request(&h).is_err());
        let mut h = request(1);
        h[4] = 9;
        assert!(parse_request(&h).is_err_and(|e| e.contains("version 9")));
        assert!(parse_request(b"PRI * HT").is_err());
        let g = granted(&[[7; 16], [8; 16]]);
        assert_eq!(g.len(), HEADER_BYTES + 32);
        let mut head = [0u8; HEADER_BYTES];
        head.copy_from_slice(&g[..HEADER_BYTES]);
        assert_eq!(parse_reply(&head), Ok(Ok(())));
        let r = refused(&"x".repeat(10_000));
        head.copy_from_slice(&r[..HEADER_BYTES]);
        assert_eq!(parse_reply(&head), Ok(Err(r.len() - HEADER_BYTES)));
        assert!(r.len() - HEADER_BYTES <= MAX_REASON_BYTES);
    }
}
