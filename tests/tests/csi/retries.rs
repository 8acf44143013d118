//! Retries as the sidecars and the kubelet make them: parallel and repeated calls are one call.

use super::{
    bail, ensure, file_params, guest, kubelet, Context, Duration, Instant, Pair, Result, MIB, NG,
};

/// Two CreateVolume calls in parallel on one NVMe namespace both succeed with disjoint windows
/// (issue 22, item 4): ublkd places each window under its own lock, where the driver used to
/// pick the same free extent for both.
#[tokio::test]
async fn parallel_nvme_creates_get_disjoint_windows() -> Result<()> {
    use kubelet::*;
    use ublkd_proto::v1;
    let pair = Pair::start("csi-nvme-parallel", 9571, "node-a").await?;
    let params = vec![
        ("backend", "nvme".to_owned()),
        ("namespace", NG.to_owned()),
        ("fsType", "ext4".to_owned()),
    ];
    for round in 0..3 {
        let (mut c1, _) = clients(&pair).await?;
        let (mut c2, _) = clients(&pair).await?;
        let (n1, n2) = (format!("pvc-par-{round}-a"), format!("pvc-par-{round}-b"));
        let (r1, r2) = tokio::join!(
            c1.create_volume(create(&n1, 32 * MIB, &params, mount_cap("ext4"))),
            c2.create_volume(create(&n2, 32 * MIB, &params, mount_cap("ext4")))
        );
        let (r1, r2) = (r1.context("first create")?, r2.context("second create")?);
        let mut windows = Vec::new();
        for r in [r1, r2] {
            let id = r.into_inner().volume.context("no volume")?.volume_id;
            let v = pair
                .daemon
                .volumes()
                .await?
                .get_volume(v1::GetVolumeRequest { id: id.clone() })
                .await?
                .into_inner();
            match v.spec.and_then(|s| s.backend) {
                Some(v1::volume_spec::Backend::Nvme(n)) => {
                    windows.push((id, n.offset_bytes.unwrap_or(0), n.length_bytes))
                }
                other => anyhow::bail!("{id}: {other:?}"),
            }
        }
        println!("round {round}: {windows:?}");
        let (a, b) = (&windows[0], &windows[1]);
        ensure!(
            a.1 + a.2 <= b.1 || b.1 + b.2 <= a.1,
            "windows overlap: {windows:?}"
        );
    }
    let (mut c, _) = clients(&pair).await?;
    for round in 0..3 {
        for s in ["a", "b"] {
            c.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
                volume_id: format!("pvc-par-{round}-{s}"),
                secrets: Default::default(),
            })
            .await?;
        }
    }
    Ok(())
}

/// A CSI call three times in parallel, then three times in sequence, as the sidecars and the
/// kubelet retry on every timeout: each result is the one a single call gives, or ABORTED
/// (operation pending) while a parallel twin runs; at least one parallel call succeeds. Returns
/// the result.
pub(crate) async fn thrice<T, F, Fut>(what: &str, call: F) -> Result<T>
where
    T: PartialEq + std::fmt::Debug,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let (a, b, c) = tokio::join!(call(), call(), call());
    let mut oks = Vec::new();
    for r in [a, b, c] {
        match r {
            Ok(r) => oks.push(r.into_inner()),
            Err(e) if e.code() == tonic::Code::Aborted => {}
            Err(e) => bail!("{what} in parallel: {e:?}"),
        }
    }
    ensure!(!oks.is_empty(), "{what}: every parallel call was ABORTED");
    let first = oks.remove(0);
    for o in &oks {
        ensure!(
            *o == first,
            "{what}: parallel results differ: {first:?} / {o:?}"
        );
    }
    for i in 0..3 {
        let again = call()
            .await
            .map_err(|e| anyhow::anyhow!("{what}, call {} in sequence: {e:?}", i + 1))?
            .into_inner();
        ensure!(
            again == first,
            "{what}: a retry answered {again:?}, not {first:?}"
        );
    }
    Ok(first)
}

/// Every Controller and Node call of a volume's life, each repeated three times in parallel
/// and three times in sequence, gives what one call gives (issue 22): idempotency is what keeps
/// data safe when the provisioner and the kubelet retry. The data written stays through it all.
#[tokio::test]
async fn every_call_retried_thrice_in_parallel_and_in_sequence_is_one_call() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let pair = Pair::start("csi-retries", 9572, "node-a").await?;
    let (ctl, node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = thrice("CreateVolume", || {
        let mut c = ctl.clone();
        let r = create("pvc-retry", 64 * MIB, &params, cap.clone());
        async move { c.create_volume(r).await }
    })
    .await?
    .volume
    .context("no volume")?;
    let id = vol.volume_id.clone();
    thrice("ValidateVolumeCapabilities", || {
        let mut c = ctl.clone();
        let r = spec::ValidateVolumeCapabilitiesRequest {
            volume_id: id.clone(),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        };
        async move { c.validate_volume_capabilities(r).await }
    })
    .await?;
    let staging = pair.kubelet.join("plugins/ublkd.io/globalmount/pvc-retry");
    let target = pair.kubelet.join("pods/r/volumes/pvc-retry");
    std::fs::create_dir_all(&staging)?;
    thrice("NodeStageVolume", || {
        let mut n = node.clone();
        let r = stage(&id, &staging, cap.clone());
        async move { n.node_stage_volume(r).await }
    })
    .await?;
    thrice("NodePublishVolume", || {
        let mut n = node.clone();
        let r = publish(&id, &staging, &target, cap.clone());
        async move { n.node_publish_volume(r).await }
    })
    .await?;
    guest::sh(&format!("echo kept > {}/f && sync", target.display()))?;
    let grown = thrice("NodeExpandVolume", || {
        let mut n = node.clone();
        let r = spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: (96 * MIB) as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        };
        async move { n.node_expand_volume(r).await }
    })
    .await?;
    ensure!(grown.capacity_bytes == (96 * MIB) as i64, "{grown:?}");
    thrice("NodeUnpublishVolume", || {
        let mut n = node.clone();
        let r = unpublish(&id, &target);
        async move { n.node_unpublish_volume(r).await }
    })
    .await?;
    thrice("NodeUnstageVolume", || {
        let mut n = node.clone();
        let r = unstage(&id, &staging);
        async move { n.node_unstage_volume(r).await }
    })
    .await?;
    // Staged again, the data is there: no retry formatted or lost anything.
    let (_, mut n) = clients(&pair).await?;
    n.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/f", staging.display()))?.trim() == "kept",
        "the data survived every retry"
    );
    n.node_unstage_volume(unstage(&id, &staging)).await?;
    thrice("DeleteVolume", || {
        let mut c = ctl.clone();
        let r = spec::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: Default::default(),
        };
        async move { c.delete_volume(r).await }
    })
    .await?;
    ensure!(
        !pair
            .daemon
            .ublkctl_ok(&["list-volumes", "--no-headers"])?
            .contains("pvc-retry"),
        "the volume is gone"
    );
    Ok(())
}

/// The external-provisioner retries CreateVolume after its timeout. A retry while the first
/// create is still running must not answer OK (the first may yet fail, and the PV would name a
/// volume that never existed): it answers ABORTED until the volume is READY, and once a call
/// answered OK the volume is there (issue 22, item 2). The create is made slow by a hook.
#[tokio::test]
async fn a_retried_create_answers_ok_only_once_the_volume_is_ready() -> Result<()> {
    use kubelet::*;
    use ublkd_proto::v1;
    let pair = Pair::start_env(
        "csi-create-retry",
        9569,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS", "delay_at=create:after_record:4000")],
    )
    .await?;
    let (mut c, _) = clients(&pair).await?;
    let params = vec![("backend", "ram".to_owned())];
    let req = || {
        let mut r = tonic::Request::new(create("pvc-slow", 16 * MIB, &params, mount_cap("ext4")));
        r.set_timeout(Duration::from_secs(1));
        r
    };
    let state = |id: &str| {
        let id = id.to_owned();
        let pair = &pair;
        async move {
            let r = pair
                .daemon
                .volumes()
                .await?
                .get_volume(v1::GetVolumeRequest { id })
                .await;
            Ok::<_, anyhow::Error>(r.map(|v| v.into_inner().state()))
        }
    };
    let own_deadline = |e: &tonic::Status| {
        e.code() == tonic::Code::Cancelled
            && std::iter::successors(std::error::Error::source(e), |s| s.source())
                .any(|s| s.is::<tonic::TimeoutExpired>())
    };
    let first = c.create_volume(req()).await;
    ensure!(
        first.is_err(),
        "the slow create answered within 1 s: {first:?}"
    );
    let started = Instant::now();
    let mut codes = Vec::new();
    loop {
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "no retry answered OK in 30 s: {codes:?}"
        );
        match c.create_volume(req()).await {
            Ok(v) => {
                let id = v.into_inner().volume.context("no volume")?.volume_id;
                let s = state(&id).await?;
                ensure!(
                    matches!(s, Ok(v1::VolumeState::Ready)),
                    "CreateVolume answered OK for {id} while ublkd has it {s:?} (retries: {codes:?})"
                );
                break;
            }
            Err(e) => {
                // A retry may run out of its own 1 s too (a slow machine, or the retry that
                // made the volume because the first was dropped before ublkd saw it): tonic
                // reports the client's own deadline as CANCELLED with `TimeoutExpired` as the
                // source; the server's as DEADLINE_EXCEEDED. Neither is an answer about the
                // volume, so either may come any number of times.
                ensure!(
                    matches!(
                        e.code(),
                        tonic::Code::Aborted | tonic::Code::DeadlineExceeded
                    ) || own_deadline(&e),
                    "a retry while creating: {e:?}"
                );
                codes.push(e.code());
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!("retries before OK: {codes:?}");
    ensure!(
        codes.contains(&tonic::Code::Aborted),
        "no retry saw the volume CREATING: the hook did not slow the create ({codes:?})"
    );
    // Once OK, the volume stays there.
    ensure!(matches!(
        state("pvc-slow").await?,
        Ok(v1::VolumeState::Ready)
    ));
    c.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: "pvc-slow".into(),
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}
