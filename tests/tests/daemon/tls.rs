//! TCP needs TLS; mutual TLS admits only known clients.

use super::{ensure, guest, Daemon, Duration, Result};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_needs_tls_and_mutual_tls_admits_only_known_clients() -> Result<()> {
    let dir = guest::scratch("tls")?;
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki)?;
    // P-256 keys, made at once: an RSA 2048 key took the emulated guest seconds (tests/src/pki.rs).
    guest::sh(&format!(
        "cd {} && \
         openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=test-ca 2>/dev/null && \
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr -subj /CN=localhost 2>/dev/null && \
         printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > server.ext && \
         openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile server.ext 2>/dev/null && \
         for role in admin modify read none; do \
           openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout $role.key -out $role.csr -subj /CN=ublkctl-$role 2>/dev/null && \
           printf 'subjectAltName=URI:urn:ublkd:role:%s\\nextendedKeyUsage=clientAuth\\n' $role > $role.ext && \
           openssl x509 -req -in $role.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $role.pem -days 1 -extfile $role.ext 2>/dev/null || exit 1; \
         done && cp admin.pem client.pem && cp admin.key client.key",
        pki.display()
    ))?;
    let p = |f: &str| pki.join(f).display().to_string();

    // A non-loopback TCP address without TLS is refused at start.
    let mut open = Daemon::new(&dir.join("open"), 19586, "")?;
    open.env
        .push(("UBLKD_GRPC__LISTEN".into(), "0.0.0.0:19700".into()));
    let err = open
        .start()
        .await
        .expect_err("plain TCP on 0.0.0.0 must be refused");
    assert!(
        format!("{err:#}").contains("without TLS"),
        "the refusal says why: {err:#}"
    );

    // TCP with mutual TLS, next to the unix socket.
    let mut d = Daemon::new(&dir.join("tls"), 19587, "")?;
    let sock = format!("unix://{}", d.socket.display());
    d.env.extend([
        ("UBLKD_GRPC__LISTEN".into(), format!("{sock},0.0.0.0:19701")),
        ("UBLKD_GRPC__TLS__CERT".into(), p("server.pem")),
        ("UBLKD_GRPC__TLS__KEY".into(), p("server.key")),
        ("UBLKD_GRPC__TLS__CLIENT_CA".into(), p("ca.pem")),
    ]);
    d.start().await?;
    let ctl_cmd = |extra: &[&str], cmd: &[&str]| -> Result<(i32, String)> {
        let out = std::process::Command::new(ublkd_tests::daemon::bin("ublkctl"))
            .args(["--endpoint", "https://127.0.0.1:19701", "--timeout", "10"])
            .args(extra)
            .args(cmd)
            .output()?;
        Ok((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        ))
    };
    let (code, out) = ctl_cmd(
        &[
            "--ca",
            &p("ca.pem"),
            "--cert",
            &p("client.pem"),
            "--key",
            &p("client.key"),
        ],
        &["node-info"],
    )?;
    assert_eq!(
        code, 0,
        "a client with a certificate from the CA gets in: {out}"
    );
    assert!(out.contains("BATCH_IO"), "{out}");

    // Roles (issue 38, defect 8): the certificate's SAN URI urn:ublkd:role:<role> decides what
    // it may call; one that names none may call nothing.
    let as_role = |role: &str, cmd: &[&str]| -> Result<(i32, String)> {
        let (cert, key) = (p(&format!("{role}.pem")), p(&format!("{role}.key")));
        ctl_cmd(&["--ca", &p("ca.pem"), "--cert", &cert, "--key", &key], cmd)
    };
    let allowed = |role: &str, cmd: &[&str]| -> Result<()> {
        let (code, out) = as_role(role, cmd)?;
        ensure!(code == 0, "{role} may {cmd:?}: {out}");
        Ok(())
    };
    let refused = |role: &str, cmd: &[&str]| -> Result<()> {
        let (code, out) = as_role(role, cmd)?;
        ensure!(
            code != 0 && out.contains("role"),
            "{role} may not {cmd:?}, and is told why: exit {code}: {out}"
        );
        Ok(())
    };
    let make = ["create-volume", "r1", "--size", "4MiB", "--backend", "null"];
    let qos = ["set-qos", "r1", "--read-iops", "100"];
    let delete = ["delete-volume", "r1"];
    refused("modify", &make)?;
    refused("read", &make)?;
    allowed("admin", &make)?;
    allowed("read", &["list-volumes"])?;
    allowed("read", &["get-volume", "r1"])?;
    refused("read", &qos)?;
    allowed("modify", &qos)?;
    allowed("modify", &["get-volume", "r1"])?;
    refused("modify", &delete)?;
    refused("read", &delete)?;
    refused("none", &["node-info"])?;
    refused("none", &["list-volumes"])?;
    allowed("admin", &delete)?;
    let ctl = |extra: &[&str]| ctl_cmd(extra, &["node-info"]);
    let (code, out) = ctl(&["--ca", &p("ca.pem")])?;
    assert_ne!(
        code, 0,
        "a client without a certificate is turned away: {out}"
    );
    let (code, out) = ctl(&[])?;
    assert_ne!(
        code, 0,
        "a client that does not trust the server's CA fails: {out}"
    );

    // Rotation without a restart: a server certificate from a new CA replaces the files (as
    // cert-manager renames them in); new connections get it, with the same ublkd process.
    let pid = d.pid();
    guest::sh(&format!(
        "cd {} && \
         openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca2.key -out ca2.pem -days 1 -subj /CN=test-ca-2 2>/dev/null && \
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server2.key -out server2.csr -subj /CN=localhost 2>/dev/null && \
         openssl x509 -req -in server2.csr -CA ca2.pem -CAkey ca2.key -CAcreateserial -out server2.pem -days 1 -extfile server.ext 2>/dev/null && \
         cp server2.key server.key.new && mv server.key.new server.key && \
         cp server2.pem server.pem.new && mv server.pem.new server.pem",
        pki.display()
    ))?;
    let with_ca = |ca: &str| -> Result<(i32, String)> {
        ctl(&[
            "--ca",
            &p(ca),
            "--cert",
            &p("client.pem"),
            "--key",
            &p("client.key"),
        ])
    };
    // The server looks at the files at most once a second: poll, bounded.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (code, out) = with_ca("ca2.pem")?;
        if code == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rotated certificate was never served: {out}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, out) = with_ca("ca.pem")?;
    assert_ne!(code, 0, "the old certificate is no longer served: {out}");
    assert_eq!(d.pid(), pid, "no restart");
    assert!(d.log().contains("TLS certificate reloaded"), "{}", d.log());
    Ok(())
}
