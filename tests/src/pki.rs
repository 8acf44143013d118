//! Certificates made with openssl, for the TLS tests: CAs, and certificates they sign, current
//! or long expired.

use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;

/// The extensions of a server certificate for `names` (`DNS:a.example,IP:127.0.0.1`).
pub fn server_ext(names: &str) -> String {
    format!("subjectAltName={names}\nextendedKeyUsage=serverAuth\n")
}

/// The extensions of a client certificate: one that may do everything (ublkd reads the role
/// from the SAN URI, `server/src/authz.rs`).
pub const CLIENT_EXT: &str =
    "subjectAltName=URI:urn:ublkd:role:admin\nextendedKeyUsage=clientAuth\n";

/// When a certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    /// From now, for a day.
    Current,
    /// On 1 January 2020 only: expired long ago.
    Expired,
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    crate::run(Command::new("openssl").args(args).current_dir(dir))
        .with_context(|| format!("openssl {}", args.join(" ")))
        .map(drop)
}

/// The keys' curve: P-256, made at once, where an RSA 2048 key took the emulated guest seconds
/// (0.44 s natively; RSA is covered by the host tests, `client/tests/tls.rs`).
const EC_CURVE: &str = "ec_paramgen_curve:prime256v1";

/// A self-signed CA: `dir/NAME.pem` and `dir/NAME.key`, valid for a day.
pub fn ca(dir: &Path, name: &str) -> Result<()> {
    let (key, pem, subj) = (
        format!("{name}.key"),
        format!("{name}.pem"),
        format!("/CN={name}"),
    );
    openssl(
        dir,
        &[
            "req", "-x509", "-newkey", "ec", "-pkeyopt", EC_CURVE, "-nodes", "-days", "1", "-subj",
            &subj, "-keyout", &key, "-out", &pem,
        ],
    )
}

/// A certificate for `cn` signed by the CA `ca` (made by [`ca`] in `dir`) with the
/// extensions `ext`: `dir/NAME.pem` and its key `dir/NAME.key`. Expired ones come from
/// `openssl ca`, which sets both dates; OpenSSL 3.0's `x509 -req` can only count days from
/// now.
pub fn issue(
    dir: &Path,
    ca: &str,
    name: &str,
    cn: &str,
    ext: &str,
    validity: Validity,
) -> Result<()> {
    let (key, csr, pem, ext_file) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}.ext"),
    );
    let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
    std::fs::write(dir.join(&ext_file), ext)?;
    let subj = format!("/CN={cn}");
    openssl(
        dir,
        &[
            "req", "-newkey", "ec", "-pkeyopt", EC_CURVE, "-nodes", "-subj", &subj, "-keyout",
            &key, "-out", &csr,
        ],
    )?;
    match validity {
        Validity::Current => openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &ca_pem,
                "-CAkey",
                &ca_key,
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                &ext_file,
                "-out",
                &pem,
            ],
        ),
        Validity::Expired => {
            // openssl ca's database, one per certificate.
            let db = dir.join(format!("{name}.ca"));
            std::fs::create_dir_all(&db)?;
            std::fs::write(db.join("index.txt"), "")?;
            std::fs::write(db.join("serial"), "1000\n")?;
            std::fs::write(
                db.join("ca.cnf"),
                "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nserial = serial\n\
                 new_certs_dir = .\ndefault_md = sha256\npolicy = p\nunique_subject = no\n\
                 [p]\ncommonName = supplied\n",
            )?;
            let up = |f: &str| format!("../{f}");
            openssl(
                &db,
                &[
                    "ca",
                    "-batch",
                    "-notext",
                    "-config",
                    "ca.cnf",
                    "-cert",
                    &up(&ca_pem),
                    "-keyfile",
                    &up(&ca_key),
                    "-in",
                    &up(&csr),
                    "-out",
                    &up(&pem),
                    "-extfile",
                    &up(&ext_file),
                    "-startdate",
                    "20200101000000Z",
                    "-enddate",
                    "20200102000000Z",
                ],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_and_expired_certificates_verify_as_such() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("ublkd-pki-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        ca(&dir, "ca")?;
        issue(&dir, "ca", "now", "a", CLIENT_EXT, Validity::Current)?;
        issue(
            &dir,
            "ca",
            "old",
            "a",
            &server_ext("DNS:a.example"),
            Validity::Expired,
        )?;
        let verify = |name: &str| {
            crate::run(
                Command::new("openssl")
                    .args(["verify", "-CAfile", "ca.pem"])
                    .arg(format!("{name}.pem"))
                    .current_dir(&dir),
            )
        };
        verify("now")?;
        let err = format!("{:#}", verify("old").expect_err("an expired certificate"));
        assert!(err.contains("certificate has expired"), "{err}");
        let dates = crate::run(
            Command::new("openssl")
                .args([
                    "x509",
                    "-noout",
                    "-enddate",
                    "-ext",
                    "subjectAltName",
                    "-in",
                ])
                .arg(dir.join("old.pem")),
        )?;
        assert!(
            dates.contains("notAfter=Jan  2 00:00:00 2020 GMT") && dates.contains("a.example"),
            "{dates}"
        );
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
