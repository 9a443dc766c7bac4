//! `kvrouter`'s index and cost model, compiled from the main workspace's sources (see ../Cargo.toml).
#[path = "../../src/config.rs"]
pub mod config;
#[path = "../../src/cost.rs"]
pub mod cost;
#[path = "../../src/error.rs"]
pub mod error;
#[path = "../../src/index.rs"]
pub mod index;
#[path = "../../src/keytable.rs"]
pub mod keytable;

pub use error::RouterError;
