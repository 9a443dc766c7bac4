//! Tenants: who may name a namespace's tenant salt, and how many bytes each tenant's blocks may
//! take in G2 and G3 (docs/configuration.md, `[[tenants]]`; docs/operations.md, "Tenants").
//!
//! A tenant is the identity that registers engines: a uid on the Unix socket (the only transport
//! engines attach over), grouped by `[[tenants]] uids`; a uid no tenant lists is a tenant of its
//! own (`uid:<n>`). A tenant salt belongs to one tenant: the one `salts_blake3` pins it to
//! (BLAKE3 of the salt, so the configuration holds no secret), else the first tenant that
//! registers an engine with it, for the life of the daemon. A registration naming a salt that
//! belongs to another tenant is refused, with the same answer whether or not anyone holds it
//! (an engine learns nothing about other tenants' salts). Keys bind the salt, so a tenant's
//! lookups can only ever reach blocks of its own salts (and of unsalted namespaces, which every
//! tenant shares by design).
//!
//! Quotas (`g2_quota_bytes`, `g3_quota_bytes`, `g4_quota_bytes`) are kept by [`crate::quota`].

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::ServerError;
use crate::limits::Principal;

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

/// The tenants of a daemon.
#[derive(Debug, Default)]
pub struct Tenants {
    /// Configured tenant index of each listed uid.
    by_uid: HashMap<u32, usize>,
    names: Vec<String>,
    /// BLAKE3 of a salt -> the tenant it belongs to (configured, or its first registrant).
    salts: Mutex<HashMap<[u8; 32], String>>,
}

fn bad(reason: impl Into<String>) -> ServerError {
    ServerError::Config { field: "tenants".into(), reason: reason.into() }
}

impl Tenants {
    /// The tenants of `cfg`, checked: names unique and non-empty, a uid and a salt in at most
    /// one tenant.
    pub fn new(cfg: &[TenantConfig]) -> Result<Self, ServerError> {
        let mut t = Tenants::default();
        let mut salts = HashMap::new();
        for (i, c) in cfg.iter().enumerate() {
            if c.name.is_empty() || c.name.starts_with("uid:") || t.names.contains(&c.name) {
                return Err(bad(format!("tenant {i}: name {:?} is empty, starts with uid: or is taken", c.name)));
            }
            for &uid in &c.uids {
                if t.by_uid.insert(uid, i).is_some() {
                    return Err(bad(format!("uid {uid} is listed by two tenants")));
                }
            }
            for h in &c.salts_blake3 {
                let mut d = [0u8; 32];
                hex::decode_to_slice(h, &mut d)
                    .map_err(|_| bad(format!("tenant {}: salts_blake3 {h:?} is not 64 hex digits", c.name)))?;
                if salts.insert(d, c.name.clone()).is_some() {
                    return Err(bad(format!("salt {h} is pinned to two tenants")));
                }
            }
            t.names.push(c.name.clone());
        }
        t.salts = Mutex::new(salts);
        Ok(t)
    }

    /// The tenant of `who`.
    pub fn tenant_of(&self, who: Principal) -> String {
        match who {
            Principal::Uid(uid) => match self.by_uid.get(&uid) {
                Some(&i) => self.names[i].clone(),
                None => format!("uid:{uid}"),
            },
            Principal::Tcp => "tcp".into(),
        }
    }

    /// The index of `who`'s tenant in `[[tenants]]`, if it is listed there (the ledger's
    /// tenant numbers, [`crate::quota::Ledger`]).
    pub fn index_of(&self, who: Principal) -> Option<usize> {
        let Principal::Uid(uid) = who else { return None };
        self.by_uid.get(&uid).copied()
    }

    /// Whether `who` may register a namespace with `salt`: an unsalted namespace always; a salt
    /// that belongs to `who`'s tenant, or to no one yet (it then becomes `who`'s tenant's).
    pub fn admit(&self, who: Principal, salt: Option<&[u8]>) -> Result<(), ServerError> {
        let Some(salt) = salt else { return Ok(()) };
        let tenant = self.tenant_of(who);
        let mut salts = self.salts.lock();
        let owner = salts.entry(*blake3::hash(salt).as_bytes()).or_insert_with(|| tenant.clone());
        if *owner == tenant {
            return Ok(());
        }
        drop(salts);
        metrics::counter!("kvcached_tenant_salt_refused_total").increment(1);
        tracing::warn!(%who, %tenant, "registration refused: its tenant salt belongs to another tenant");
        Err(ServerError::Attach(format!(
            "the namespace's tenant_salt belongs to another tenant than {tenant} (a salt is bound to the tenant that \
             first registers it, or to the one [[tenants]] salts_blake3 names)"
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cfg() -> Vec<TenantConfig> {
        vec![
            TenantConfig {
                name: "a".into(),
                uids: vec![1000, 1001],
                salts_blake3: vec![blake3::hash(b"pinned").to_hex().to_string()],
                g2_quota_bytes: 300,
                ..Default::default()
            },
            TenantConfig { name: "b".into(), uids: vec![2000], ..Default::default() },
        ]
    }

    #[test]
    fn salts_belong_to_one_tenant() {
        let t = Tenants::new(&cfg()).unwrap();
        let (a0, a1, b, other) = (Principal::Uid(1000), Principal::Uid(1001), Principal::Uid(2000), Principal::Uid(7));
        assert!(t.admit(b, Some(b"pinned")).is_err(), "pinned to a");
        assert!(t.admit(a1, Some(b"pinned")).is_ok());
        assert!(t.admit(b, Some(b"mine")).is_ok(), "first registrant");
        assert!(t.admit(a0, Some(b"mine")).is_err());
        assert!(t.admit(other, Some(b"mine")).is_err());
        assert!(t.admit(b, Some(b"mine")).is_ok());
        for who in [a0, b, other] {
            assert!(t.admit(who, None).is_ok(), "unsalted namespaces are shared");
        }
        assert_eq!(t.tenant_of(other), "uid:7");
        assert_eq!(
            (t.index_of(a0), t.index_of(a1), t.index_of(b), t.index_of(other)),
            (Some(0), Some(0), Some(1), None)
        );
    }

    #[test]
    fn bad_configurations_are_refused() {
        let mut c = cfg();
        c[1].uids.push(1000);
        assert!(Tenants::new(&c).is_err());
        let mut c = cfg();
        c[1].salts_blake3 = c[0].salts_blake3.clone();
        assert!(Tenants::new(&c).is_err());
        let mut c = cfg();
        c[1].name = "a".into();
        assert!(Tenants::new(&c).is_err());
        let mut c = cfg();
        c[0].salts_blake3 = vec!["xyz".into()];
        assert!(Tenants::new(&c).is_err());
    }
}
