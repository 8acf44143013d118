//! `ublkctl` run in a node's ublkd pod through the API server (the exec subresource, as
//! `kubectl exec` does): the node's ublkd answers on its unix socket, so no remote-access
//! certificate is needed, only the user's right to exec in ublkd's namespace.

use anyhow::{bail, Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams};
use kube::Client;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The container and the path of ublkctl in the ublkd pod (deploy/helm/ublkd/templates/daemonset.yaml).
pub const CONTAINER: &str = "ublkd";
pub const UBLKCTL: &str = "/usr/local/bin/ublkctl";

async fn read_all(r: Option<impl AsyncRead + Unpin>) -> Result<String> {
    let mut text = String::new();
    if let Some(mut r) = r {
        r.read_to_string(&mut text)
            .await
            .context("reading the command's output")?;
    }
    Ok(text)
}

/// Runs `ublkctl ARGS` in `pod` and returns its standard output; a failure carries what it
/// printed on standard error.
pub async fn ublkctl(client: Client, namespace: &str, pod: &str, args: &[&str]) -> Result<String> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let mut command = vec![UBLKCTL];
    command.extend_from_slice(args);
    let params = AttachParams::default()
        .container(CONTAINER)
        .stdin(false)
        .stdout(true)
        .stderr(true);
    let mut attached = api
        .exec(pod, command, &params)
        .await
        .with_context(|| format!("exec in {namespace}/{pod}"))?;
    let status = attached
        .take_status()
        .context("the exec gave no status channel")?;
    let (out, err) = tokio::join!(read_all(attached.stdout()), read_all(attached.stderr()));
    let (out, err) = (out?, err?);
    let status = status.await;
    attached
        .join()
        .await
        .with_context(|| format!("exec in {namespace}/{pod}"))?;
    match status.as_ref().and_then(|s| s.status.as_deref()) {
        Some("Success") => Ok(out),
        _ => bail!(
            "ublkctl {} in {namespace}/{pod} failed: {}{}",
            args.join(" "),
            err.trim(),
            status
                .and_then(|s| s.message)
                .map(|m| format!(" ({m})"))
                .unwrap_or_default()
        ),
    }
}
