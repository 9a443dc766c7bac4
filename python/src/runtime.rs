//! The tokio runtime every `Client` of a process shares.
//!
//! A Python engine makes its calls from whatever threads it has (vLLM's scheduler loop, worker
//! threads, an asyncio executor); each call blocks its own thread on this runtime with the GIL
//! released, and the runtime's worker threads carry the connections and the heartbeats between
//! calls. One runtime per process rather than one per client: a vLLM process holding a
//! scheduler-side and a worker-side connector needs no more than two threads of it.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::runtime::Runtime;

/// The runtime and the process it was made in.
static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// This process's runtime, made on first use.
///
/// A child forked after the runtime was made inherits its memory but none of its threads: the
/// inherited runtime would never run a task. The child gets a runtime of its own, and the
/// inherited one is leaked, because dropping it would wait for threads that do not exist here.
pub fn runtime() -> std::io::Result<Arc<Runtime>> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock();
    if let Some((made_in, rt)) = slot.as_ref()
        && *made_in == pid
    {
        return Ok(Arc::clone(rt));
    }
    if let Some((_, inherited)) = slot.take() {
        std::mem::forget(inherited);
    }
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvcached-py")
            .enable_all()
            .build()?,
    );
    *slot = Some((pid, Arc::clone(&rt)));
    Ok(rt)
}
