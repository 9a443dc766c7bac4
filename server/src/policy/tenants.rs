//! Tenants and the trust model (docs/operations/security-clients.md, "Who may read and write a
//! namespace"): who may name a namespace's tenant salt, who may write and who may read each
//! namespace's blocks, and how many bytes each tenant's blocks may take in G2, G3 and G4.
//!
//! A tenant is the identity that registers engines: a uid on the Unix socket (the only transport
//! engines attach over), grouped by `[[tenants]] uids`; a uid no tenant lists is a tenant of its
//! own (`uid:<n>`).
//!
//! - **Salts.** A tenant salt belongs to one tenant: the one `salts_blake3` pins it to (BLAKE3 of
//!   the salt, so the configuration holds no secret), else the first tenant whose registration
//!   with it succeeds. A refused registration binds nothing, and a registration naming a salt of
//!   another tenant gets the same answer whatever else is wrong with it (the salt is checked
//!   after the rest of the request), so an engine learns nothing about other tenants' salts. A
//!   salted namespace is read and written by its salt's tenant only.
//! - **Unsalted namespaces.** Written only by their writers and read by their writers and
//!   readers: those a `[[namespaces]]` entry names, else the first tenant whose registration in
//!   the namespace succeeds (its owner). An engine of a tenant that may not read a namespace is
//!   not attached to it; one that may read but not write is attached, and its saves are refused.
//!   So no tenant is ever served blocks written by a tenant it does not trust.
//! - **Kept across restarts.** Bindings (salts and owners) are written to a file
//!   ([`Tenants::persist_to`], `g3.dir/bindings.toml` when G3 is on: G3's blocks outlive the
//!   process, so must the record of who wrote them) and read back at start. Without G3, blocks
//!   and bindings end with the process; pin salts and writers in the configuration to bind them
//!   for good.
//!
//! Quotas (`g2_quota_bytes`, `g3_quota_bytes`, `g4_quota_bytes`) are applied by the tiers
//! (`kvtiers::quota`): a save's blocks name the saver's tenant as their owner.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvproto::{Namespace, NamespaceId};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::ServerError;
use crate::policy::limits::Principal;

pub use crate::config::{NamespaceRule, TenantConfig};

/// What a tenant may do in a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rights {
    pub read: bool,
    pub write: bool,
}

/// Bindings made at run time, kept in [`Tenants::persist_to`]'s file.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Bound {
    /// BLAKE3 of a salt (hex) -> its tenant.
    salts: HashMap<String, String>,
    /// Namespace id (hex) -> its owner.
    owners: HashMap<String, String>,
}

#[derive(Debug, Default)]
struct State {
    /// BLAKE3 of a salt -> the tenant it belongs to (configured, or its first registrant).
    salts: HashMap<[u8; 32], String>,
    /// Unsalted namespaces no rule names -> their first registrant's tenant.
    owners: HashMap<NamespaceId, String>,
}

/// The tenants of a daemon.
#[derive(Debug, Default)]
pub struct Tenants {
    /// Configured tenant index of each listed uid.
    by_uid: HashMap<u32, usize>,
    names: Vec<String>,
    /// Salts pinned by `salts_blake3` (never rebound).
    pinned: HashMap<[u8; 32], String>,
    rules: Vec<NamespaceRule>,
    state: Mutex<State>,
    /// Taken while the bindings file is written ([`Tenants::save`]).
    saving: Mutex<()>,
    /// Where bindings are kept across restarts.
    file: Option<PathBuf>,
}

fn bad(reason: impl Into<String>) -> ServerError {
    ServerError::Config { field: "tenants".into(), reason: reason.into() }
}

impl Tenants {
    /// The tenants of `cfg`, checked: names unique and non-empty, a uid and a salt in at most
    /// one tenant.
    pub fn new(cfg: &[TenantConfig], rules: &[NamespaceRule]) -> Result<Self, ServerError> {
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
        for (i, r) in rules.iter().enumerate() {
            let bad_rule = |why: String| ServerError::Config { field: format!("namespaces[{i}]"), reason: why };
            match (r.id.is_empty(), r.model_id.is_empty()) {
                (true, true) | (false, false) => return Err(bad_rule("name exactly one of id and model_id".into())),
                (false, true) if hex16(&r.id).is_none() => {
                    return Err(bad_rule(format!("id {:?} is not 32 hex digits", r.id)));
                }
                _ => {}
            }
            for who in r.writers.iter().chain(&r.readers) {
                let known = who == "*" || who.starts_with("uid:") || t.names.contains(who);
                if !known || (who == "*" && r.writers.contains(who)) {
                    return Err(bad_rule(format!(
                        "{who:?} is not a tenant name, uid:<n>{}",
                        if r.writers.contains(who) { "" } else { " or \"*\"" }
                    )));
                }
            }
        }
        t.rules = rules.to_vec();
        t.pinned = salts.clone();
        t.state = Mutex::new(State { salts, owners: HashMap::new() });
        Ok(t)
    }

    /// Keeps bindings in `file` from now on, after reading those a previous process kept there
    /// (a salt pinned in the configuration keeps its pin).
    pub fn persist_to(mut self, file: PathBuf) -> Result<Self, ServerError> {
        let io = |e: std::io::Error| ServerError::Config {
            field: "tenants".into(),
            reason: format!("{}: {e}", file.display()),
        };
        let bound: Bound = match std::fs::read_to_string(&file) {
            Ok(b) => toml::from_str(&b).map_err(|e| ServerError::Config {
                field: "tenants".into(),
                reason: format!(
                    "{}: not a bindings file ({e}); move it away to start without its bindings",
                    file.display()
                ),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Bound::default(),
            Err(e) => return Err(io(e)),
        };
        {
            let mut st = self.state.lock();
            for (h, tenant) in bound.salts {
                let mut d = [0u8; 32];
                if hex::decode_to_slice(&h, &mut d).is_ok() && !self.pinned.contains_key(&d) {
                    st.salts.insert(d, tenant);
                }
            }
            for (ns, tenant) in bound.owners {
                if let Some(id) = hex16(&ns) {
                    st.owners.insert(NamespaceId(id), tenant);
                }
            }
            tracing::info!(
                salts = st.salts.len(),
                owners = st.owners.len(),
                file = %file.display(),
                "tenant bindings read"
            );
        }
        self.file = Some(file);
        Ok(self)
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

    /// The index of `who`'s tenant in `[[tenants]]`, if it is listed there: the owner its saves
    /// charge their blocks to (`kvtiers::quota`, quotas set by `Config::store_config`).
    pub fn index_of(&self, who: Principal) -> Option<usize> {
        let Principal::Uid(uid) = who else { return None };
        self.by_uid.get(&uid).copied()
    }

    /// What `who` may do in `ns`, checked before anything is mapped or bound: a salt of
    /// another tenant's is refused (with one answer, whether or not anyone holds it), and so is a
    /// namespace `who` may not read. Nothing is bound here: [`Tenants::bind`] does that once the
    /// registration has succeeded.
    pub fn rights(&self, who: Principal, ns: &Namespace) -> Result<Rights, ServerError> {
        let tenant = self.tenant_of(who);
        let st = self.state.lock();
        if let Some(salt) = ns.tenant_salt.as_deref() {
            return match st.salts.get(blake3::hash(salt).as_bytes()) {
                Some(owner) if *owner != tenant => {
                    drop(st);
                    metrics::counter!("kvcached_tenant_salt_refused_total").increment(1);
                    tracing::warn!(%who, %tenant, "registration refused: its tenant salt belongs to another tenant");
                    Err(ServerError::Denied(format!(
                        "the namespace's tenant_salt belongs to another tenant than {tenant} (a salt is bound to the \
                         tenant whose registration with it first succeeds, or to the one [[tenants]] salts_blake3 names)"
                    )))
                }
                _ => Ok(Rights { read: true, write: true }),
            };
        }
        let id = ns.id();
        let rights = match self.rule_of(&id, &ns.model_id) {
            Some(r) => {
                let write = r.writers.contains(&tenant);
                Rights { write, read: write || r.readers.iter().any(|w| w == "*" || *w == tenant) }
            }
            None => match st.owners.get(&id) {
                Some(owner) if *owner != tenant => Rights::default(),
                _ => Rights { read: true, write: true },
            },
        };
        drop(st);
        if !rights.read {
            metrics::counter!("kvcached_namespace_refused_total", "op" => "register").increment(1);
            tracing::warn!(%who, %tenant, namespace = %id, "registration refused: the namespace is another tenant's");
            return Err(ServerError::Denied(format!(
                "{tenant} may not read namespace {id} (model {}): its blocks are written by another tenant. Use a \
                 tenant salt of your own (vLLM's cache_salt), or ask the operator to name {tenant} among the \
                 namespace's readers or writers ([[namespaces]], docs/operations/security-clients.md)",
                kvproto::limits::clip(&ns.model_id, 64)
            )));
        }
        Ok(rights)
    }

    /// Binds `ns`'s salt, or its ownership where no rule names it, to `who`'s tenant, once a
    /// registration has succeeded; refused if another tenant's registration bound it meanwhile.
    pub fn bind(&self, who: Principal, ns: &Namespace) -> Result<(), ServerError> {
        let tenant = self.tenant_of(who);
        let mut st = self.state.lock();
        let (fresh, won) = match ns.tenant_salt.as_deref() {
            Some(salt) => bind_once(&mut st.salts, *blake3::hash(salt).as_bytes(), &tenant),
            None if self.rule_of(&ns.id(), &ns.model_id).is_some() => (false, true),
            None => bind_once(&mut st.owners, ns.id(), &tenant),
        };
        if !won {
            drop(st);
            // Lost a race with another tenant's registration: the answer `rights` gives now.
            return self.rights(who, ns).map(|_| ());
        }
        if !fresh {
            return Ok(());
        }
        drop(st);
        if ns.tenant_salt.is_none() {
            tracing::info!(%tenant, namespace = %ns.id(), "namespace bound to its first registrant's tenant (its writer)");
        }
        self.save();
        Ok(())
    }

    /// Writes the bindings to the file, if any (a failure is logged: the bindings hold for this
    /// process's life). Saves run one at a time, each writing the bindings as they are when it
    /// starts, so the file ends with the newest (two binds racing cannot leave the older last);
    /// the state's lock is held only to copy them, never across the write.
    fn save(&self) {
        let Some(file) = &self.file else { return };
        let _one = self.saving.lock();
        let st = self.state.lock();
        let b = &Bound {
            salts: st
                .salts
                .iter()
                .filter(|(h, _)| !self.pinned.contains_key(*h))
                .map(|(h, t)| (hex::encode(h), t.clone()))
                .collect(),
            owners: st.owners.iter().map(|(id, t)| (id.to_string(), t.clone())).collect(),
        };
        drop(st);
        let tmp = file.with_extension("toml.tmp");
        let r = toml::to_string(b)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, file));
        if let Err(e) = r {
            tracing::error!(file = %file.display(), "cannot keep tenant bindings for the next start: {e}");
        }
    }

    /// The rule naming namespace `id`, else the first naming its model.
    fn rule_of(&self, id: &NamespaceId, model: &str) -> Option<&NamespaceRule> {
        let hex = id.to_string();
        self.rules
            .iter()
            .find(|r| r.id.eq_ignore_ascii_case(&hex))
            .or_else(|| self.rules.iter().find(|r| !r.model_id.is_empty() && r.model_id == model))
    }

    /// Where bindings are kept, if anywhere.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }
}

/// Binds `key` to `tenant` unless it is bound: (whether it was bound now, whether it is
/// `tenant`'s).
fn bind_once<K: std::hash::Hash + Eq>(map: &mut HashMap<K, String>, key: K, tenant: &str) -> (bool, bool) {
    match map.entry(key) {
        std::collections::hash_map::Entry::Occupied(o) => (false, o.get() == tenant),
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert(tenant.to_string());
            (true, true)
        }
    }
}

fn hex16(s: &str) -> Option<[u8; 16]> {
    let mut d = [0u8; 16];
    hex::decode_to_slice(s, &mut d).ok().map(|()| d)
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

    fn salted(salt: &[u8]) -> Namespace {
        let mut n = plain("m");
        n.tenant_salt = Some(salt.to_vec());
        n
    }

    fn plain(model: &str) -> Namespace {
        let layout = kvproto::KvLayout {
            num_layers: 2,
            kv_heads: 2,
            head_dim: 64,
            dtype: kvproto::Dtype::Bf16,
            tokens_per_block: 16,
            kind: kvproto::LayoutKind::LayerSeparate,
        };
        Namespace::new(model, layout)
    }

    /// Admitted and bound, as a successful registration is.
    fn register(t: &Tenants, who: Principal, ns: &Namespace) -> Result<Rights, ServerError> {
        let r = t.rights(who, ns)?;
        t.bind(who, ns)?;
        Ok(r)
    }

    #[test]
    fn salts_belong_to_one_tenant_and_bind_only_on_success() {
        let t = Tenants::new(&cfg(), &[]).unwrap();
        let (a0, a1, b, other) = (Principal::Uid(1000), Principal::Uid(1001), Principal::Uid(2000), Principal::Uid(7));
        assert!(t.rights(b, &salted(b"pinned")).is_err(), "pinned to a");
        assert!(register(&t, a1, &salted(b"pinned")).is_ok());
        // Finding 8 of issue 35: asking (a registration that then fails) binds nothing.
        assert!(t.rights(other, &salted(b"mine")).is_ok());
        assert!(register(&t, b, &salted(b"mine")).is_ok(), "the first registration that succeeds binds it");
        let (e1, e2) = (t.rights(a0, &salted(b"mine")).unwrap_err(), t.rights(other, &salted(b"mine")).unwrap_err());
        assert!(matches!(e1, ServerError::Denied(_)) && matches!(e2, ServerError::Denied(_)));
        assert!(register(&t, b, &salted(b"mine")).is_ok());
        assert_eq!(t.tenant_of(other), "uid:7");
        assert_eq!(
            (t.index_of(a0), t.index_of(a1), t.index_of(b), t.index_of(other)),
            (Some(0), Some(0), Some(1), None)
        );
    }

    /// Finding 3 of issue 35: an unsalted namespace's blocks are written by its owner (its first
    /// registrant's tenant) or the writers a rule names; no one else reads them unless a rule
    /// says so.
    #[test]
    fn unsalted_namespaces_are_written_by_their_owner_or_named_writers() {
        let rules = vec![NamespaceRule {
            model_id: "shared".into(),
            writers: vec!["a".into()],
            readers: vec!["*".into()],
            ..Default::default()
        }];
        let t = Tenants::new(&cfg(), &rules).unwrap();
        let (a0, a1, b, other) = (Principal::Uid(1000), Principal::Uid(1001), Principal::Uid(2000), Principal::Uid(7));
        assert_eq!(register(&t, other, &plain("m")).unwrap(), Rights { read: true, write: true });
        assert!(matches!(t.rights(a0, &plain("m")), Err(ServerError::Denied(_))), "uid 7 owns it");
        assert_eq!(register(&t, other, &plain("m")).unwrap(), Rights { read: true, write: true });
        // The rule: a writes, everyone reads, nobody owns it by registering first.
        assert_eq!(register(&t, b, &plain("shared")).unwrap(), Rights { read: true, write: false });
        assert_eq!(register(&t, a1, &plain("shared")).unwrap(), Rights { read: true, write: true });
        // Bindings outlive the process where a file keeps them.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bindings.toml");
        let t = Tenants::new(&cfg(), &rules).unwrap().persist_to(file.clone()).unwrap();
        register(&t, other, &plain("m")).unwrap();
        register(&t, b, &salted(b"b's")).unwrap();
        let again = Tenants::new(&cfg(), &rules).unwrap().persist_to(file.clone()).unwrap();
        assert!(again.rights(a0, &plain("m")).is_err() && again.rights(other, &plain("m")).is_ok());
        assert!(again.rights(a0, &salted(b"b's")).is_err() && again.rights(b, &salted(b"b's")).is_ok());
        std::fs::write(&file, b"not json").unwrap();
        assert!(Tenants::new(&cfg(), &rules).unwrap().persist_to(file).is_err());
    }

    #[test]
    fn bad_configurations_are_refused() {
        let mut c = cfg();
        c[1].uids.push(1000);
        assert!(Tenants::new(&c, &[]).is_err());
        let mut c = cfg();
        c[1].salts_blake3 = c[0].salts_blake3.clone();
        assert!(Tenants::new(&c, &[]).is_err());
        let mut c = cfg();
        c[1].name = "a".into();
        assert!(Tenants::new(&c, &[]).is_err());
        let mut c = cfg();
        c[0].salts_blake3 = vec!["xyz".into()];
        assert!(Tenants::new(&c, &[]).is_err());
        let rule = |id: &str, model: &str, writer: &str| NamespaceRule {
            id: id.into(),
            model_id: model.into(),
            writers: vec![writer.into()],
            readers: vec![],
        };
        for bad in [rule("", "", "a"), rule("00", "", "a"), rule("", "m", "nobody"), rule("", "m", "*")] {
            assert!(Tenants::new(&cfg(), std::slice::from_ref(&bad)).is_err(), "{bad:?}");
        }
        assert!(Tenants::new(&cfg(), &[rule("", "m", "uid:5")]).is_ok());
    }
}
