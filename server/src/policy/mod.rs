//! Who may do what, and how much: the rules a request is held to before it uses the store.
//!
//! - [`limits`]: what each uid holds (connections, engines and their mapped memory, loads,
//!   bytes arriving), the limits, and the fair shares of the totals.
//! - [`tenants`]: the trust model: who may name which tenant salt, who writes and who reads
//!   each namespace (bindings kept across restarts).
//! - [`quota`]: what each tenant's blocks may take in G2, G3 and G4, charged where they land.

pub mod limits;
pub mod quota;
pub mod tenants;
