//! A throw-away PKI for tests (feature `testing`): a CA, certificates it signs (server names,
//! client identities, already expired ones), and a second CA nobody trusts, written as PEM
//! files into a directory.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// A certificate and key as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA able to sign more certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub cert: PathBuf,
    dir: PathBuf,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").field("cert", &self.cert).finish()
    }
}

fn write(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path.to_path_buf()
}

impl Ca {
    /// A new CA named `name`, its certificate written to `dir/<name>.crt`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("key: {e}"));
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::CrlSign];
        let cert = p.self_signed(&key).unwrap_or_else(|e| panic!("CA: {e}"));
        let path = write(&dir.join(format!("{name}.crt")), &cert.pem());
        Self { issuer: Issuer::new(p, key), cert: path, dir: dir.to_path_buf() }
    }

    /// A certificate for `names` (DNS names or IP addresses), for servers and clients alike,
    /// valid from `days_from_now.0` to `days_from_now.1` days from now (negative: the past).
    pub fn issue(&self, file: &str, names: &[&str], days_from_now: (i64, i64)) -> CertFiles {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("key: {e}"));
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names.clone()).unwrap_or_else(|e| panic!("{e}"));
        if let Some(n) = names.first() {
            p.distinguished_name.push(DnType::CommonName, n.as_str());
        }
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now + time::Duration::days(days_from_now.0);
        p.not_after = now + time::Duration::days(days_from_now.1);
        let cert = p.signed_by(&key, &self.issuer).unwrap_or_else(|e| panic!("certificate: {e}"));
        CertFiles {
            cert: write(&self.dir.join(format!("{file}.crt")), &cert.pem()),
            key: write(&self.dir.join(format!("{file}.key")), &key.serialize_pem()),
        }
    }

    /// A certificate valid now for a year.
    pub fn valid(&self, file: &str, names: &[&str]) -> CertFiles {
        self.issue(file, names, (-1, 365))
    }

    /// A certificate that expired yesterday.
    pub fn expired(&self, file: &str, names: &[&str]) -> CertFiles {
        self.issue(file, names, (-30, -1))
    }
}
