//! Which addresses this daemon dials when a load or a prefetch names sources. An engine is a
//! less trusted client than the daemon: without this check it could make the daemon connect
//! anywhere and present the daemon's own credentials (`peer.client`) to whoever listens there.
//! A source is dialed only if it is one of `peer.peers`, equals a `host:port` entry of
//! `peer.allowed_sources`, or is an IP address inside one of its networks (`10.0.0.0/8`,
//! `fd00::/8`, any port). Everything else is refused without a connection, counted in
//! `kvcached_peer_sources_refused_total`, and the load reads G4 or misses.

use std::net::{IpAddr, SocketAddr};

/// One `peer.allowed_sources` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Allowed {
    /// A `host:port` as engines and routers name it.
    Exact(String),
    /// An IP network: its first address and prefix length.
    Network(IpAddr, u8),
}

/// The sources a daemon may dial.
#[derive(Debug, Clone, Default)]
pub struct SourcePolicy {
    allowed: Vec<Allowed>,
}

impl SourcePolicy {
    /// The policy of `peers` (always allowed) and `allowed_sources`; an entry that is neither
    /// `host:port` nor `ADDRESS/PREFIX` is an error naming it.
    pub fn new(peers: &[String], allowed_sources: &[String]) -> Result<Self, String> {
        let mut allowed: Vec<Allowed> = peers.iter().map(|p| Allowed::Exact(p.clone())).collect();
        for e in allowed_sources {
            allowed.push(parse(e)?);
        }
        Ok(Self { allowed })
    }

    /// Whether `source` may be dialed.
    pub fn allows(&self, source: &str) -> bool {
        let ip = source.parse::<SocketAddr>().ok().map(|a| a.ip());
        self.allowed.iter().any(|a| match a {
            Allowed::Exact(s) => s == source,
            Allowed::Network(net, len) => ip.is_some_and(|ip| within(ip, *net, *len)),
        })
    }
}

fn parse(e: &str) -> Result<Allowed, String> {
    if let Some((addr, len)) = e.split_once('/') {
        let ip: IpAddr = addr.parse().map_err(|_| format!("{e:?}: {addr:?} is not an IP address"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let len: u8 =
            len.parse().ok().filter(|l| *l <= max).ok_or_else(|| format!("{e:?}: the prefix is not 0..={max}"))?;
        return Ok(Allowed::Network(ip, len));
    }
    let (host, port) = e.rsplit_once(':').ok_or_else(|| format!("{e:?} is neither host:port nor ADDRESS/PREFIX"))?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return Err(format!("{e:?} is neither host:port nor ADDRESS/PREFIX"));
    }
    Ok(Allowed::Exact(e.to_string()))
}

fn within(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    let bits = |ip: IpAddr| match ip {
        // IPv4 (and IPv4-mapped IPv6) compare as the low 32 bits of a 128-bit number.
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), 32u32),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => (u128::from(u32::from(v4)), 32),
            None => (u128::from(v6), 128),
        },
    };
    let ((a, wa), (n, wn)) = (bits(ip), bits(net));
    if wa != wn {
        return false;
    }
    let len = u32::from(len).min(wn);
    let shift = wn - len;
    shift >= 128 || (a >> shift) == (n >> shift)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn peers_entries_and_networks_are_allowed_and_nothing_else() {
        let p = SourcePolicy::new(&["prefill-0.kv:7471".into()], &["10.1.0.0/16".into()]).unwrap();
        assert!(p.allows("prefill-0.kv:7471"));
        assert!(p.allows("10.1.200.7:7471") && p.allows("10.1.0.1:1"));
        assert!(!p.allows("10.2.0.1:7471") && !p.allows("127.0.0.1:7471") && !p.allows("evil.example:7471"));
        assert!(!p.allows("prefill-0.kv:7472"), "a listed name is allowed on its port only");
        assert!(!p.allows("") && !p.allows("10.1.0.1") && !p.allows("garbage"));

        let p = SourcePolicy::new(&[], &["decode-3:7471".into(), "fd00::/8".into(), "127.0.0.0/8".into()]).unwrap();
        assert!(p.allows("decode-3:7471") && p.allows("[fd12::1]:7471") && p.allows("127.9.9.9:80"));
        assert!(p.allows("[::ffff:127.0.0.1]:7471"), "IPv4-mapped");
        assert!(!p.allows("[fe80::1]:7471") && !p.allows("[::1]:7471"));

        let any = SourcePolicy::new(&[], &["0.0.0.0/0".into()]).unwrap();
        assert!(any.allows("192.168.1.1:1") && !any.allows("[2001:db8::1]:1"));
        assert!(!SourcePolicy::default().allows("127.0.0.1:7471"), "nothing by default");
    }

    #[test]
    fn malformed_entries_are_named() {
        for bad in ["10.0.0.0/33", "10.0.0/8", "fd00::/129", "host", ":7471", "host:port", "::1/x"] {
            let e = SourcePolicy::new(&[], &[bad.to_string()]).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
