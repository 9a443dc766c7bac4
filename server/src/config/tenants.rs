//! `[[tenants]]` and `[[namespaces]]`: the trust model's settings (applied by
//! [`crate::policy::tenants`]).

use serde::{Deserialize, Serialize};

/// One `[[tenants]]` entry.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's name (logs and errors).
    pub name: String,
    /// The uids whose engines are this tenant's.
    pub uids: Vec<u32>,
    /// BLAKE3 (64 hex digits) of the tenant salts only this tenant may name
    /// (`b3sum` of the salt's bytes).
    pub salts_blake3: Vec<String>,
    /// Most bytes of this tenant's blocks in G2 (0: no quota).
    pub g2_quota_bytes: u64,
    /// Most bytes of this tenant's blocks in G3 (0: no quota).
    pub g3_quota_bytes: u64,
    /// Most bytes of the blocks this tenant saved that this daemon keeps in G4 (0: no quota).
    pub g4_quota_bytes: u64,
}

/// One `[[namespaces]]` entry: who writes and who reads the unsalted namespaces it matches.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NamespaceRule {
    /// The namespace id (32 hex digits, as the daemon logs it); or empty, with `model_id`.
    pub id: String,
    /// Every unsalted namespace of this model (any layout, dtype or adapter); or empty, with `id`.
    pub model_id: String,
    /// Tenants (names of `[[tenants]]`, or `uid:<n>`) whose engines may save into it.
    pub writers: Vec<String>,
    /// Tenants that may read it besides its writers; `"*"`: every tenant.
    pub readers: Vec<String>,
}
