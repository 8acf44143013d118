//! Remote access as an operator has it (deploy/README.md, "Remote access"): several nodes'
//! ublkd, each serving gRPC over TCP with mutual TLS and a CA of its own, reached by ublkctl
//! through named profiles; and the certificates either side refuses, each reported as what
//! happened and what to do.
#![cfg(feature = "vm")]

use anyhow::{ensure, Result};
use std::path::Path;
use std::process::Command;
use ublkd_tests::daemon::{bin, Daemon};
use ublkd_tests::guest;
use ublkd_tests::pki::{self, Validity};

/// The name a shared server certificate carries and clients check, as in the Kubernetes
/// component (`tls_domain`).
const SHARED_NAME: &str = "ublkd-grpc.ublkd-system.svc";

/// A ublkd listening on its unix socket and on 127.0.0.1:`port` with mutual TLS: `cert` and
/// its key from `pki`, client certificates from the CA `client_ca`.
async fn node(
    dir: &Path,
    pki: &Path,
    metrics: u16,
    port: u16,
    cert: &str,
    client_ca: &str,
) -> Result<Daemon> {
    let mut d = Daemon::new(dir, metrics, "")?;
    let p = |f: String| pki.join(f).display().to_string();
    d.env.extend([
        (
            "UBLKD_GRPC__LISTEN".into(),
            format!("unix://{},127.0.0.1:{port}", d.socket.display()),
        ),
        ("UBLKD_GRPC__TLS__CERT".into(), p(format!("{cert}.pem"))),
        ("UBLKD_GRPC__TLS__KEY".into(), p(format!("{cert}.key"))),
        (
            "UBLKD_GRPC__TLS__CLIENT_CA".into(),
            p(format!("{client_ca}.pem")),
        ),
    ]);
    d.start().await?;
    Ok(d)
}

/// One `[nodes.NAME]` of the profile file.
fn profile(
    name: &str,
    port: u16,
    pki: &Path,
    ca: &str,
    client: &str,
    domain: Option<&str>,
) -> String {
    let p = |f: &str| pki.join(f).display().to_string();
    let mut s = format!(
        "[nodes.{name}]\nendpoint = \"https://127.0.0.1:{port}\"\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        p(&format!("{ca}.pem")),
        p(&format!("{client}.pem")),
        p(&format!("{client}.key")),
    );
    if let Some(d) = domain {
        s += &format!("tls_domain = {d:?}\n");
    }
    s + "\n"
}

/// `ublkctl --node NODE ARGS` with the profile file `config`: (exit code, stdout, stderr).
fn ctl(config: &Path, node: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let out = Command::new(bin("ublkctl"))
        .env("UBLKCTL_CONFIG", config)
        .env_remove("UBLKCTL_ENDPOINT")
        .args(["--timeout", "20", "--node", node])
        .args(args)
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn ctl_ok(config: &Path, node: &str, args: &[&str]) -> Result<String> {
    let (code, out, err) = ctl(config, node, args)?;
    ensure!(
        code == 0,
        "ublkctl --node {node} {args:?} exited {code}: {err}{out}"
    );
    Ok(out)
}

/// Runs a command that must be refused for a certificate: exit 3, and an error naming the
/// side that refused, the file to fix and what to do (`words`, all of them), never the
/// unreachable daemon's "is it running?".
fn refused(config: &Path, node: &str, words: &[&str]) -> Result<()> {
    let (code, out, err) = ctl(config, node, &["list-volumes"])?;
    ensure!(code == 3, "--node {node}: exit {code}, not 3: {err}{out}");
    for w in words {
        ensure!(
            err.contains(w),
            "--node {node}: the error lacks {w:?}: {err}"
        );
    }
    ensure!(!err.contains("is it running"), "--node {node}: {err}");
    Ok(())
}

/// Volume ids a daemon lists, asked over its own unix socket.
fn ids(d: &Daemon) -> Result<Vec<String>> {
    let out = d.ublkctl_ok(&["list-volumes", "--no-headers"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ublkctl_reaches_each_node_by_profile_and_refused_certificates_say_what_to_do() -> Result<()>
{
    let dir = guest::scratch("remote")?;
    let pki_dir = dir.join("pki");
    std::fs::create_dir_all(&pki_dir)?;
    let k = pki_dir.as_path();
    // Node a: one shared server name, as the Kubernetes component has it, so its clients
    // check tls_domain. Node b: a certificate for its address. Each has its own CA, which
    // signs its server and client certificates alike. Node c has an expired one from a's CA.
    pki::ca(k, "ca-a")?;
    pki::ca(k, "ca-b")?;
    let server = |names: &str| pki::server_ext(names);
    pki::issue(
        k,
        "ca-a",
        "server-a",
        "ublkd",
        &server(&format!("DNS:{SHARED_NAME}")),
        Validity::Current,
    )?;
    pki::issue(
        k,
        "ca-b",
        "server-b",
        "ublkd",
        &server("IP:127.0.0.1"),
        Validity::Current,
    )?;
    pki::issue(
        k,
        "ca-a",
        "server-c",
        "ublkd",
        &server(&format!("DNS:{SHARED_NAME}")),
        Validity::Expired,
    )?;
    pki::issue(
        k,
        "ca-a",
        "client-a",
        "alice",
        pki::CLIENT_EXT,
        Validity::Current,
    )?;
    pki::issue(
        k,
        "ca-b",
        "client-b",
        "alice",
        pki::CLIENT_EXT,
        Validity::Current,
    )?;
    pki::issue(
        k,
        "ca-a",
        "client-a-expired",
        "alice",
        pki::CLIENT_EXT,
        Validity::Expired,
    )?;

    let a = node(&dir.join("a"), k, 19611, 19711, "server-a", "ca-a").await?;
    let b = node(&dir.join("b"), k, 19612, 19712, "server-b", "ca-b").await?;
    let c = node(&dir.join("c"), k, 19613, 19713, "server-c", "ca-a").await?;

    let config = dir.join("ublkctl.toml");
    let shared = Some(SHARED_NAME);
    std::fs::write(
        &config,
        [
            profile("a", 19711, k, "ca-a", "client-a", shared),
            profile("b", 19712, k, "ca-b", "client-b", None),
            // What goes wrong.
            profile("a-foreign-client", 19711, k, "ca-a", "client-b", shared),
            profile(
                "a-expired-client",
                19711,
                k,
                "ca-a",
                "client-a-expired",
                shared,
            ),
            profile("a-wrong-ca", 19711, k, "ca-b", "client-a", shared),
            profile("a-no-domain", 19711, k, "ca-a", "client-a", None),
            profile("c-expired-server", 19713, k, "ca-a", "client-a", shared),
        ]
        .concat(),
    )?;

    // Each profile reaches its own node.
    let dev_a = ctl_ok(
        &config,
        "a",
        &["create-volume", "va", "--size", "64MiB", "--backend", "ram"],
    )?;
    let dev_b = ctl_ok(
        &config,
        "b",
        &["create-volume", "vb", "--size", "32MiB", "--backend", "ram"],
    )?;
    ensure!(
        Path::new(dev_a.trim()).exists() && Path::new(dev_b.trim()).exists(),
        "devices {dev_a:?} {dev_b:?}"
    );
    assert_eq!(ids(&a)?, ["va"], "a has its own volume only");
    assert_eq!(ids(&b)?, ["vb"], "b has its own volume only");
    assert_eq!(ids(&c)?, Vec::<String>::new());
    let listed = ctl_ok(&config, "b", &["list-volumes", "--no-headers"])?;
    ensure!(
        listed.contains("vb") && !listed.contains("va"),
        "--node b lists b's volumes: {listed}"
    );
    let got: serde_json::Value =
        serde_json::from_str(&ctl_ok(&config, "a", &["get-volume", "va", "-o", "json"])?)?;
    assert_eq!(got["spec"]["size_bytes"], 64 << 20, "{got}");

    // The server refuses the client's certificate.
    refused(
        &config,
        "a-foreign-client",
        &[
            "ublkd at https://127.0.0.1:19711 refused this client's certificate",
            "client-b.pem",
            "not signed by the CA ublkd trusts for clients",
        ],
    )?;
    refused(
        &config,
        "a-expired-client",
        &[
            "refused this client's certificate",
            "client-a-expired.pem: it has expired",
            "renew it",
        ],
    )?;
    // The client refuses the server's certificate.
    refused(
        &config,
        "c-expired-server",
        &[
            "ublkd at https://127.0.0.1:19713 presented a certificate this client does not accept",
            "its certificate expired",
            "renew it on the node",
        ],
    )?;
    refused(
        &config,
        "a-wrong-ca",
        &[
            "its certificate is not signed by the CA in",
            "ca-b.pem",
            "--ca",
        ],
    )?;
    refused(
        &config,
        "a-no-domain",
        &[
            "not valid for the name \"127.0.0.1\"",
            SHARED_NAME,
            "tls_domain",
        ],
    )?;
    // Refused connections changed nothing.
    assert_eq!(ids(&a)?, ["va"]);

    // Clean up through the same profiles.
    ctl_ok(&config, "a", &["delete-volume", "va"])?;
    ctl_ok(&config, "b", &["delete-volume", "vb"])?;
    assert_eq!(ids(&a)?, Vec::<String>::new());
    assert_eq!(ids(&b)?, Vec::<String>::new());
    for (name, mut d) in [("a", a), ("b", b), ("c", c)] {
        let st = d.stop_with(libc::SIGTERM)?;
        ensure!(st.success(), "ublkd {name} exited {st}:\n{}", d.log());
    }
    Ok(())
}
