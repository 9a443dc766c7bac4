//! Who may do what, and how much: the rules a request is held to before it uses the store.
//!
//! - [`limits`]: what each uid holds (connections, engines and their mapped memory, loads,
//!   bytes arriving), the limits, and the fair shares of the totals.
//! - [`tenants`]: the trust model: who may name which tenant salt, who writes and who reads
//!   each namespace (bindings kept across restarts).

pub mod limits;
pub mod tenants;
