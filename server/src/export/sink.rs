//! Where the publisher's messages go ([`Sink`]): each router's `POST /events`
//! ([`crate::export::publish::HttpSink`]) or the NATS event plane ([`crate::export::bus`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use kvproto::events::PublisherMessage;

/// A boxed future (sinks are trait objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Per target (a router's URL, the NATS stream): the last attempt's failure (when and why),
/// `None` after a success.
pub type TargetHealth = Arc<parking_lot::Mutex<HashMap<String, Option<(Instant, String)>>>>;

/// Where messages go. A sink records its targets' health in the [`TargetHealth`] it was given.
pub trait Sink: Send {
    /// Ships one message; returns when it is delivered or given up on.
    fn ship<'a>(&'a mut self, msg: &'a PublisherMessage) -> BoxFuture<'a, ()>;
}
