//! One wrapper for the daemon's connection types ([`crate::edge::listen::Conn`],
//! [`crate::edge::listen::GuardedTcp`], [`crate::edge::h2_authority::HeaderFix`]): a stream and
//! what is kept beside it. Writes go straight to the stream; reads go through the part beside
//! it ([`ReadSide`]), which passes them straight through unless it says otherwise; gRPC's
//! connect info is the stream's where the side is no connection of its own ([`SameConnection`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The stream `io` and `side`, what is kept beside it.
#[derive(Debug)]
pub struct Passthrough<IO, S> {
    pub(crate) io: IO,
    pub(crate) side: S,
}

/// How a [`Passthrough`] reads its stream: as it comes, unless the side reads it its own way.
pub trait ReadSide<IO: AsyncRead + Unpin>: Unpin {
    fn poll_read(&mut self, io: &mut IO, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(io).poll_read(cx, buf)
    }
}

/// A side that is no connection of its own: gRPC's connect info is the stream's.
pub trait SameConnection {}

impl<IO: Connected, S: SameConnection> Connected for Passthrough<IO, S> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin, S: ReadSide<IO>> AsyncRead for Passthrough<IO, S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.side.poll_read(&mut this.io, cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin, S: Unpin> AsyncWrite for Passthrough<IO, S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
