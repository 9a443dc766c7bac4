//! Blocking (thread-per-connection) variants of the guard's accept and the connector's
//! connect, for data paths that copy straight between sockets and memory owned by a
//! synchronous closure (the peer channel reads into and writes from G2's pages).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use rustls::{ClientConnection, ServerConnection, StreamOwned};
use rustls_pki_types::ServerName;

use crate::connector::{Connector, host_of};
use crate::error::NetError;
use crate::guard::{Guard, PeerCert};
use crate::tls::Stream;

/// A blocking connection: plain TCP or TLS over it.
#[derive(Debug)]
pub enum SyncStream {
    Plain(TcpStream),
    ServerTls(Box<StreamOwned<ServerConnection, TcpStream>>),
    ClientTls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl SyncStream {
    /// The TCP socket under it (timeouts, shutdown).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            SyncStream::Plain(s) => s,
            SyncStream::ServerTls(s) => &s.sock,
            SyncStream::ClientTls(s) => &s.sock,
        }
    }
}

impl Read for SyncStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SyncStream::Plain(s) => s.read(buf),
            SyncStream::ServerTls(s) => s.read(buf),
            SyncStream::ClientTls(s) => s.read(buf),
        }
    }
}

impl Write for SyncStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            SyncStream::Plain(s) => s.write(buf),
            SyncStream::ServerTls(s) => s.write(buf),
            SyncStream::ClientTls(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            SyncStream::Plain(s) => s.write_vectored(bufs),
            SyncStream::ServerTls(s) => s.write_vectored(bufs),
            SyncStream::ClientTls(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            SyncStream::Plain(s) => s.flush(),
            SyncStream::ServerTls(s) => s.flush(),
            SyncStream::ClientTls(s) => s.flush(),
        }
    }
}

impl Guard {
    /// [`Guard::accept`] on a blocking socket: the TLS handshake within `timeout`.
    pub fn accept_blocking(&self, tcp: TcpStream, timeout: Duration) -> Result<(SyncStream, PeerCert), NetError> {
        let Some(cfg) = self.server_config() else {
            return Ok((SyncStream::Plain(tcp), PeerCert::default()));
        };
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        let mut conn = ServerConnection::new(cfg).map_err(|e| NetError::Tls(e.to_string()))?;
        let mut sock = tcp;
        while conn.is_handshaking() {
            conn.complete_io(&mut sock).map_err(|e| NetError::Tls(e.to_string()))?;
        }
        let cert = PeerCert::of(conn.peer_certificates());
        Ok((SyncStream::ServerTls(Box::new(StreamOwned::new(conn, sock))), cert))
    }
}

impl Stream<tokio::net::TcpStream> {
    /// The connection on a blocking socket: one accepted (and authenticated) on the runtime,
    /// handed to a thread that serves it. What it was to send must have been flushed; what it
    /// received and was not read yet stays in the TLS state and is read first.
    pub fn into_blocking(self) -> io::Result<SyncStream> {
        let blocking = |tcp: tokio::net::TcpStream| -> io::Result<TcpStream> {
            let s = tcp.into_std()?;
            s.set_nonblocking(false)?;
            Ok(s)
        };
        Ok(match self {
            Stream::Plain(tcp) => SyncStream::Plain(blocking(tcp)?),
            Stream::Tls(tls) => match *tls {
                tokio_rustls::TlsStream::Server(s) => {
                    let (tcp, conn) = s.into_inner();
                    SyncStream::ServerTls(Box::new(StreamOwned::new(conn, blocking(tcp)?)))
                }
                tokio_rustls::TlsStream::Client(s) => {
                    let (tcp, conn) = s.into_inner();
                    SyncStream::ClientTls(Box::new(StreamOwned::new(conn, blocking(tcp)?)))
                }
            },
        })
    }
}

impl Connector {
    /// [`Connector::connect`] on a blocking socket: connect and handshake within `timeout`.
    pub fn connect_blocking(&self, addr: &str, timeout: Duration) -> Result<SyncStream, NetError> {
        use std::net::ToSocketAddrs;
        let mut last = None;
        let mut tcp = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let tcp = match (tcp, last) {
            (Some(t), _) => t,
            (None, Some(e)) => return Err(NetError::Io(e)),
            (None, None) => return Err(NetError::Config(format!("{addr} resolves to no address"))),
        };
        let _ = tcp.set_nodelay(true);
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        let Some(cfg) = self.client_config() else { return Ok(SyncStream::Plain(tcp)) };
        let host = self.server_name().unwrap_or_else(|| host_of(addr).to_string());
        let name = ServerName::try_from(host.clone())
            .map_err(|_| NetError::Config(format!("{host:?} is not a name a TLS certificate can carry")))?;
        let mut conn = ClientConnection::new(cfg, name).map_err(|e| NetError::Tls(e.to_string()))?;
        let mut sock = tcp;
        while conn.is_handshaking() {
            conn.complete_io(&mut sock).map_err(|e| NetError::Tls(e.to_string()))?;
        }
        Ok(SyncStream::ClientTls(Box::new(StreamOwned::new(conn, sock))))
    }
}
