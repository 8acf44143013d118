//! Snapshots restore their data; classes change limits live.

use super::{ensure, file_params, guest, kubelet, Context, Pair, ReflinkRoot, Result, MIB};

/// Snapshots and clones through the driver, with the data checked through mounts: a snapshot
/// holds what was written before it and not after, a restore and a clone hold what their
/// source held, and each reports its content source. A VolumeAttributesClass at creation and
/// ControllerModifyVolume later set the volume's limits in ublkd, merged key by key.
#[tokio::test]
async fn snapshots_restore_their_data_and_classes_change_limits_live() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec::{self, volume_content_source as vcs};
    let name = "csi-snap";
    let dir = guest::scratch(name)?;
    let root = ReflinkRoot::at(&dir, &dir.join("roots"))?;
    let pair = Pair::start(name, 9568, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&root.root, "ext4");
    let cap = mount_cap("ext4");

    let mut req = create("pvc-src", 64 * MIB, &params, cap.clone());
    req.parameters.insert("readIops".into(), "4000".into());
    req.mutable_parameters = [("writeBandwidth".to_owned(), "100Mi".to_owned())].into();
    ctl.create_volume(req).await?;
    let mut ublkd = pair.daemon.volumes().await?;
    let limits = |v: ublkd_proto::v1::Volume| v.spec.and_then(|s| s.qos).unwrap_or_default();
    let get = |id: &str| ublkd_proto::v1::GetVolumeRequest { id: id.into() };
    let q = limits(ublkd.get_volume(get("pvc-src")).await?.into_inner());
    ensure!(
        q.read_iops == 4000 && q.write_bytes_per_second == 100 << 20,
        "limits at creation: {q:?}"
    );

    // Data before the snapshot, more after it.
    let staging = pair.kubelet.join("staging/pvc-src");
    let target = pair.kubelet.join("pods/src/pvc-src");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage("pvc-src", &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish("pvc-src", &staging, &target, cap.clone()))
        .await?;
    guest::sh(&format!("echo before > {}/data && sync", target.display()))?;
    let snap = ctl
        .create_snapshot(spec::CreateSnapshotRequest {
            source_volume_id: "pvc-src".into(),
            name: "snapshot-1".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .context("no snapshot")?;
    ensure!(
        snap.ready_to_use && snap.snapshot_id == "snapshot-1",
        "{snap:?}"
    );
    guest::sh(&format!("echo after > {}/data && sync", target.display()))?;

    // ControllerModifyVolume: live, merged over what the volume has.
    ctl.controller_modify_volume(spec::ControllerModifyVolumeRequest {
        volume_id: "pvc-src".into(),
        mutable_parameters: [
            ("readIops".to_owned(), "unlimited".to_owned()),
            ("writeIops".to_owned(), "300".to_owned()),
        ]
        .into(),
        secrets: Default::default(),
    })
    .await?;
    let q = limits(ublkd.get_volume(get("pvc-src")).await?.into_inner());
    ensure!(
        q.read_iops == 0 && q.write_iops == 300 && q.write_bytes_per_second == 100 << 20,
        "limits after modify: {q:?}"
    );
    guest::sh(&format!(
        "echo limited > {}/data2 && sync",
        target.display()
    ))
    .context("I/O under the new limits")?;

    // A restore holds the snapshot's data; a clone the volume's now.
    let from = |t: vcs::Type| spec::VolumeContentSource { r#type: Some(t) };
    let sources = [
        (
            "pvc-restored",
            from(vcs::Type::Snapshot(vcs::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            })),
            "before",
        ),
        (
            "pvc-clone",
            from(vcs::Type::Volume(vcs::VolumeSource {
                volume_id: "pvc-src".into(),
            })),
            "after",
        ),
    ];
    for (id, source, want) in sources {
        let mut r = create(id, 64 * MIB, &params, cap.clone());
        r.volume_content_source = Some(source.clone());
        let v = ctl
            .create_volume(r)
            .await?
            .into_inner()
            .volume
            .context("no volume")?;
        ensure!(v.content_source == Some(source), "{id}: {v:?}");
        let st = pair.kubelet.join(format!("staging/{id}"));
        let t = pair.kubelet.join(format!("pods/{id}/{id}"));
        std::fs::create_dir_all(&st)?;
        node.node_stage_volume(stage(id, &st, cap.clone())).await?;
        node.node_publish_volume(publish(id, &st, &t, cap.clone()))
            .await?;
        let got = guest::sh(&format!("cat {}/data", t.display()))?;
        ensure!(got.trim() == want, "{id} holds {got:?}, not {want:?}");
        node.node_unpublish_volume(unpublish(id, &t)).await?;
        node.node_unstage_volume(unstage(id, &st)).await?;
    }

    // A RAM volume cannot be snapshotted: INVALID_ARGUMENT, nothing taken.
    ctl.create_volume(create(
        "pvc-ram",
        16 * MIB,
        &[("backend", "ram".to_owned())],
        cap.clone(),
    ))
    .await?;
    let e = ctl
        .create_snapshot(spec::CreateSnapshotRequest {
            source_volume_id: "pvc-ram".into(),
            name: "snapshot-ram".into(),
            ..Default::default()
        })
        .await
        .expect_err("a RAM volume has no file to reflink");
    ensure!(e.code() == tonic::Code::InvalidArgument, "{e:?}");

    node.node_unpublish_volume(unpublish("pvc-src", &target))
        .await?;
    node.node_unstage_volume(unstage("pvc-src", &staging))
        .await?;
    ctl.delete_snapshot(spec::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        secrets: Default::default(),
    })
    .await?;
    for id in ["pvc-restored", "pvc-clone", "pvc-src", "pvc-ram"] {
        ctl.delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: Default::default(),
        })
        .await?;
    }
    let left = guest::sh(&format!(
        "find {} -name '*.img' | wc -l",
        root.root.display()
    ))?;
    ensure!(left.trim() == "0", "backing files and copies left: {left}");
    // ublkd's stop waits for its clients' connections, closed by this runtime while it sleeps.
    drop((ublkd, ctl, node));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    drop(pair);
    Ok(())
}
