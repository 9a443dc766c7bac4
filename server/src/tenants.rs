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
//! Quotas: a tenant with `g2_quota_bytes` (`g3_quota_bytes`) keeps at most that many bytes of
//! the blocks it saved in G2 (G3): a save that would pass the quota first removes the tenant's
//! own oldest blocks from that tier, so a tenant at its quota evicts itself, never another. A
//! block larger than the quota is not saved. Blocks are charged to the tenant whose save stored
//! them; blocks recovered from G3 at start are charged to no one.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvproto::{BlockKey, TierKind};
use kvtiers::{BlockStore, Tier};
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
}

/// The blocks one tenant saved into one tier, oldest first, and their bytes.
#[derive(Debug, Default)]
struct Charged {
    quota: u64,
    bytes: u64,
    blocks: VecDeque<(BlockKey, u64)>,
}

impl Charged {
    /// Victims to remove so that `need` more bytes fit; `None` when `need` alone is over quota.
    fn make_room(&mut self, need: u64) -> Option<Vec<BlockKey>> {
        if need > self.quota {
            return None;
        }
        let mut out = Vec::new();
        while self.bytes + need > self.quota {
            let Some((k, n)) = self.blocks.pop_front() else { break };
            self.bytes -= n;
            out.push(k);
        }
        Some(out)
    }

    fn charge(&mut self, key: BlockKey, n: u64) {
        self.bytes += n;
        self.blocks.push_back((key, n));
    }
}

/// A configured tenant's quotas.
#[derive(Debug)]
pub struct Quota {
    name: String,
    g2: Mutex<Charged>,
    g3: Mutex<Charged>,
}

impl Quota {
    /// Makes room for one block of `bytes` in every tier with a quota, removing this tenant's
    /// own oldest blocks; false when the block is larger than a quota (it is not to be saved).
    pub fn make_room(&self, store: &BlockStore, bytes: u64) -> bool {
        for (tier, charged) in [(TierKind::G2Host, &self.g2), (TierKind::G3Disk, &self.g3)] {
            let victims = {
                let mut c = charged.lock();
                if c.quota == 0 {
                    continue;
                }
                match c.make_room(bytes) {
                    Some(v) => v,
                    None => return false,
                }
            };
            // Outside the lock: the tiers call their listeners while removing.
            for k in &victims {
                let removed = if tier == TierKind::G2Host {
                    store.g2().remove(k).unwrap_or(false)
                } else {
                    store.lower().iter().filter(|t| t.kind() == tier).any(|t| t.remove(k).unwrap_or(false))
                };
                if removed {
                    metrics::counter!("kvcached_tenant_quota_evictions_total", "tenant" => self.name.clone(), "tier" => tier.to_string()).increment(1);
                }
            }
        }
        true
    }

    /// Charges a block this tenant's save stored.
    pub fn charge(&self, key: BlockKey, bytes: u64) {
        for charged in [&self.g2, &self.g3] {
            let mut c = charged.lock();
            if c.quota > 0 {
                c.charge(key, bytes);
            }
        }
    }

    /// Bytes charged to this tenant in G2 and G3.
    pub fn charged(&self) -> (u64, u64) {
        (self.g2.lock().bytes, self.g3.lock().bytes)
    }
}

/// The tenants of a daemon.
#[derive(Debug, Default)]
pub struct Tenants {
    /// Configured tenant index of each listed uid.
    by_uid: HashMap<u32, usize>,
    names: Vec<String>,
    quotas: Vec<Option<Arc<Quota>>>,
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
            let quota = (c.g2_quota_bytes > 0 || c.g3_quota_bytes > 0).then(|| {
                Arc::new(Quota {
                    name: c.name.clone(),
                    g2: Mutex::new(Charged { quota: c.g2_quota_bytes, ..Default::default() }),
                    g3: Mutex::new(Charged { quota: c.g3_quota_bytes, ..Default::default() }),
                })
            });
            t.names.push(c.name.clone());
            t.quotas.push(quota);
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

    /// The quotas of `who`'s tenant, if it has any.
    pub fn quota_of(&self, who: Principal) -> Option<Arc<Quota>> {
        let Principal::Uid(uid) = who else { return None };
        self.quotas.get(*self.by_uid.get(&uid)?)?.clone()
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
        assert!(t.quota_of(a0).is_some() && t.quota_of(b).is_none());
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

    #[test]
    fn charges_evict_the_oldest_first_and_refuse_what_cannot_fit() {
        let mut c = Charged { quota: 300, ..Default::default() };
        for i in 0..3u8 {
            assert!(c.make_room(100).unwrap().is_empty());
            c.charge(BlockKey([i; 16]), 100);
        }
        assert_eq!(c.make_room(150).unwrap(), vec![BlockKey([0; 16]), BlockKey([1; 16])]);
        assert_eq!(c.bytes, 100);
        assert!(c.make_room(301).is_none());
    }
}
