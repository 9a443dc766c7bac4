//! Limits both sides of the engine API know: what a client may send and what the daemon refuses,
//! and how user-supplied text is bounded before it is logged or echoed in an error.

/// Largest token area (64 MiB: 16M tokens).
pub const TOKEN_AREA_MAX_BYTES: u64 = 64 << 20;
/// Longest engine name.
pub const ENGINE_NAME_MAX_BYTES: usize = 128;
/// Longest worker address (`http://host:port`).
pub const WORKER_ADDRESS_MAX_BYTES: usize = 256;
/// Longest model id in a namespace.
pub const MODEL_ID_MAX_BYTES: usize = 256;
/// Default largest gRPC message the daemon accepts: 8 MiB, 2M tokens inline (longer prompts go
/// through the token area). The daemon's `limits.max_message_bytes` sets it.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 8 << 20;

/// `s` cut to at most `max` bytes on a character boundary, with the number of bytes left out
/// when it was cut, for logs and error messages that quote what a client sent.
pub fn clip(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut end = max.saturating_sub(24);
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!("{}... ({} bytes more)", &s[..end], s.len() - end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_bounds_and_keeps_characters_whole() {
        assert_eq!(clip("short", 64), "short");
        let long = "é".repeat(10_000);
        let c = clip(&long, 100);
        assert!(c.len() <= 100 && c.contains("bytes more"), "{c}");
    }
}
