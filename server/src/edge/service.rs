//! The gRPC edge: translates `kvcached.v1.Kvcached` calls to [`Daemon`] and errors to
//! `tonic::Status`. Copies run on blocking threads so the runtime never stalls on memcpy.
//!
//! Every call that names an engine passes its caller ([`principal`]): an engine answers only the
//! uid that registered it. Over TCP ([`TcpService`]) only Health is served until authentication
//! exists; engines attach over the Unix socket.

use std::sync::Arc;
use std::time::Duration;

use kvproto::pb;
use kvproto::reason::Reason;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::edge::caller::{TcpPeer, blocking, peer_pid, principal};
use crate::metrics_catalog::Rpc;

/// The service object handed to tonic for the Unix socket.
#[derive(Debug, Clone)]
pub struct KvcachedService {
    pub daemon: Arc<Daemon>,
    pub queue_capacity: usize,
}

#[tonic::async_trait]
impl pb::kvcached_server::Kvcached for KvcachedService {
    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let rpc = Rpc::start("register");
        let r: Result<Response<pb::RegisterResponse>, Status> = async move {
            let d = Arc::clone(&self.daemon);
            let (who, pid) = (principal(&req), peer_pid(&req));
            let req = req.into_inner();
            let e = blocking(move || d.engines.register(&req, who, pid)).await?;
            self.daemon.reports.attached(&e);
            let lease = self.daemon.engines.lease.as_millis() as u32;
            Ok(Response::new(pb::RegisterResponse {
                engine_id: e.id,
                namespace_id: e.namespace_id.0.to_vec(),
                block_bytes: e.block_bytes(),
                heartbeat_ms: lease / 3,
                lease_ms: lease,
                token_area_accepted: e.token_area.is_some(),
                token_area_error: e.token_area_error.clone(),
            }))
        }
        .await;
        rpc.done(r)
    }

    async fn unregister(&self, req: Request<pb::EngineRef>) -> Result<Response<pb::Empty>, Status> {
        let rpc = Rpc::start("unregister");
        let r: Result<Response<pb::Empty>, Status> = async move {
            let who = principal(&req);
            let e = self.daemon.engines.unregister(req.into_inner().engine_id, who)?;
            self.daemon.reports.detached(&e);
            Ok(Response::new(pb::Empty {}))
        }
        .await;
        rpc.done(r)
    }

    async fn heartbeat(&self, req: Request<pb::EngineRef>) -> Result<Response<pb::Empty>, Status> {
        let rpc = Rpc::start("heartbeat");
        let r: Result<Response<pb::Empty>, Status> = async move {
            let who = principal(&req);
            self.daemon.engines.get(req.into_inner().engine_id, who)?;
            Ok(Response::new(pb::Empty {}))
        }
        .await;
        rpc.done(r)
    }

    async fn save(&self, req: Request<pb::SaveRequest>) -> Result<Response<pb::SaveResponse>, Status> {
        let rpc = Rpc::start("save");
        let r: Result<Response<pb::SaveResponse>, Status> = async move {
            let d = Arc::clone(&self.daemon);
            let who = principal(&req);
            let req = req.into_inner();
            Ok(Response::new(blocking(move || d.save(&req, who)).await?))
        }
        .await;
        rpc.done(r)
    }

    async fn lookup(&self, req: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        let rpc = Rpc::start("lookup");
        let r: Result<Response<pb::LookupResponse>, Status> = async move {
            let d = Arc::clone(&self.daemon);
            let who = principal(&req);
            let req = req.into_inner();
            Ok(Response::new(blocking(move || d.lookup(&req, who)).await?))
        }
        .await;
        rpc.done(r)
    }

    async fn load(&self, req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadStatus>, Status> {
        let rpc = Rpc::start("load");
        let r: Result<Response<pb::LoadStatus>, Status> = async move {
            let who = principal(&req);
            let req = req.into_inner();
            let (op, engine, tx, held) = self.daemon.start_load(&req, who)?;
            let d = Arc::clone(&self.daemon);
            let wait = req.wait;
            let mut rx = tx.subscribe();
            let task = tokio::task::spawn_blocking(move || {
                d.run_load(op, &engine, &req, &tx);
                drop(held);
            });
            if !wait {
                return Ok(Response::new(pb::LoadStatus { op_id: op, ..Default::default() }));
            }
            task.await.map_err(|e| Status::internal(format!("load failed: {e}")))?;
            let s = rx.borrow_and_update().clone();
            Ok(Response::new(s))
        }
        .await;
        rpc.done(r)
    }

    async fn wait(&self, req: Request<pb::WaitRequest>) -> Result<Response<pb::LoadStatus>, Status> {
        let rpc = Rpc::start("wait");
        let r: Result<Response<pb::LoadStatus>, Status> = async move {
            let who = principal(&req);
            let r = req.into_inner();
            let s = self
                .daemon
                .wait(r.engine_id, r.op_id, Duration::from_millis(u64::from(r.timeout_ms)), r.until_blocks, who)
                .await?;
            Ok(Response::new(s))
        }
        .await;
        rpc.done(r)
    }

    async fn stats(&self, _: Request<pb::Empty>) -> Result<Response<pb::StatsResponse>, Status> {
        let rpc = Rpc::start("stats");
        let r: Result<Response<pb::StatsResponse>, Status> =
            async move { Ok(Response::new(self.daemon.stats())) }.await;
        rpc.done(r)
    }

    async fn health(&self, _: Request<pb::Empty>) -> Result<Response<pb::HealthResponse>, Status> {
        let rpc = Rpc::start("health");
        let r: Result<Response<pb::HealthResponse>, Status> =
            async move { Ok(Response::new(self.daemon.health(self.queue_capacity))) }.await;
        rpc.done(r)
    }

    async fn report_gpu_blocks(
        &self,
        req: Request<pb::GpuBlocksRequest>,
    ) -> Result<Response<pb::GpuBlocksResponse>, Status> {
        let rpc = Rpc::start("report_gpu_blocks");
        let r: Result<Response<pb::GpuBlocksResponse>, Status> = async move {
            let d = Arc::clone(&self.daemon);
            let who = principal(&req);
            let req = req.into_inner();
            Ok(Response::new(blocking(move || d.gpu_blocks(&req, who)).await?))
        }
        .await;
        rpc.done(r)
    }

    async fn report_load(&self, req: Request<pb::EngineLoadRequest>) -> Result<Response<pb::Empty>, Status> {
        let rpc = Rpc::start("report_load");
        let r: Result<Response<pb::Empty>, Status> = async move {
            let who = principal(&req);
            let r = req.into_inner();
            let e = self.daemon.engines.get(r.engine_id, who)?;
            self.daemon.reports.engine_load(&e, &r);
            Ok(Response::new(pb::Empty {}))
        }
        .await;
        rpc.done(r)
    }
}

/// The service on the TCP listener: Health only. Engines attach and work over the Unix socket;
/// nothing else is served over TCP until it is authenticated.
#[derive(Debug, Clone)]
pub struct TcpService {
    pub inner: KvcachedService,
}

/// The TCP listener's per-request check (`tcp_auth`): a bearer token in `authorization`, or the
/// client certificate of the connection ([`TcpPeer`]); a request without
/// acceptable credentials is refused `UNAUTHENTICATED` with what to present, before any
/// service sees it.
#[derive(Debug, Clone)]
pub struct TcpAuth {
    pub guard: Arc<kvnet::Guard>,
}

impl tonic::service::Interceptor for TcpAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let cert = req.extensions().get::<TcpPeer>().map(|p| p.cert.clone()).unwrap_or_default();
        let bearer = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(kvnet::bearer_of);
        let who = self.guard.authenticate(&cert, bearer).map_err(|r| Status::unauthenticated(r.to_string()))?;
        req.extensions_mut().insert(who);
        Ok(req)
    }
}

fn tcp_refused<T>() -> Result<Response<T>, Status> {
    let mut s = Status::permission_denied(
        "over TCP kvcached serves only Health: engines attach over the node's Unix socket (docs/operations/security.md)",
    );
    if let Ok(v) = Reason::WrongTransport.name().parse() {
        s.metadata_mut().insert(kvproto::reason::METADATA_KEY, v);
    }
    Err(s)
}

#[tonic::async_trait]
impl pb::kvcached_server::Kvcached for TcpService {
    async fn register(&self, _: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        tcp_refused()
    }
    async fn unregister(&self, _: Request<pb::EngineRef>) -> Result<Response<pb::Empty>, Status> {
        tcp_refused()
    }
    async fn heartbeat(&self, _: Request<pb::EngineRef>) -> Result<Response<pb::Empty>, Status> {
        tcp_refused()
    }
    async fn save(&self, _: Request<pb::SaveRequest>) -> Result<Response<pb::SaveResponse>, Status> {
        tcp_refused()
    }
    async fn lookup(&self, _: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        tcp_refused()
    }
    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadStatus>, Status> {
        tcp_refused()
    }
    async fn wait(&self, _: Request<pb::WaitRequest>) -> Result<Response<pb::LoadStatus>, Status> {
        tcp_refused()
    }
    async fn stats(&self, _: Request<pb::Empty>) -> Result<Response<pb::StatsResponse>, Status> {
        tcp_refused()
    }
    async fn health(&self, req: Request<pb::Empty>) -> Result<Response<pb::HealthResponse>, Status> {
        pb::kvcached_server::Kvcached::health(&self.inner, req).await
    }
    async fn report_gpu_blocks(
        &self,
        _: Request<pb::GpuBlocksRequest>,
    ) -> Result<Response<pb::GpuBlocksResponse>, Status> {
        tcp_refused()
    }
    async fn report_load(&self, _: Request<pb::EngineLoadRequest>) -> Result<Response<pb::Empty>, Status> {
        tcp_refused()
    }
}
