//! A decorator around an object store that adds what a distant or failing store does: latency
//! on every request, and (switchable while running) failure of every request. For tests and
//! benchmarks (`g4.inject_latency_ms`; the fault suites); production stores are not wrapped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore, PutMultipartOptions,
    PutOptions, PutPayload, PutResult, Result,
};

/// The switches of a [`FaultyStore`], shared with whoever drives the faults.
#[derive(Debug, Default)]
pub struct Faults {
    /// Every request fails (as a store that is down would) while set.
    pub down: AtomicBool,
    /// Milliseconds added to every request while set (a slow store), beside the fixed latency.
    pub latency_ms: AtomicU64,
}

impl Faults {
    fn latency(&self, fixed: Duration) -> Duration {
        fixed + Duration::from_millis(self.latency_ms.load(Ordering::Relaxed))
    }
}

/// `inner` with `latency` added to every request and the failures `faults` switches on.
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    latency: Duration,
    faults: Arc<Faults>,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn ObjectStore>, latency: Duration, faults: Arc<Faults>) -> Self {
        Self { inner, latency, faults }
    }

    async fn enter(&self) -> Result<()> {
        let latency = self.faults.latency(self.latency);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if self.faults.down.load(Ordering::Relaxed) {
            return Err(object_store::Error::Generic {
                store: "faulty",
                source: "the store is down (injected fault)".into(),
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FaultyStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        self.enter().await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(&self, location: &Path, opts: PutMultipartOptions) -> Result<Box<dyn MultipartUpload>> {
        self.enter().await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.enter().await?;
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(&self, locations: BoxStream<'static, Result<Path>>) -> BoxStream<'static, Result<Path>> {
        let latency = self.faults.latency(self.latency);
        let down = self.faults.down.load(Ordering::Relaxed);
        let inner = Arc::clone(&self.inner);
        futures_util::stream::once(async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            if down {
                let err = object_store::Error::Generic {
                    store: "faulty",
                    source: "the store is down (injected fault)".into(),
                };
                return futures_util::stream::once(async move { Err(err) }).boxed();
            }
            inner.delete_stream(locations)
        })
        .flatten()
        .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        if self.faults.down.load(Ordering::Relaxed) {
            let err =
                object_store::Error::Generic { store: "faulty", source: "the store is down (injected fault)".into() };
            return futures_util::stream::once(async move { Err(err) }).boxed();
        }
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.enter().await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.enter().await?;
        self.inner.copy_opts(from, to, options).await
    }
}
