//! The kubelet's own sequence of calls, with data checked through mounts and a ublkd crash.

use super::{
    ensure, file_params, guest, kubelet, Command, Context, Duration, Pair, Path, Result, Stdio, MIB,
};

/// The kubelet's path: provision, stage, publish twice, write, unpublish and unstage, stage
/// and publish again and find the data; ublkd is killed with -9 and restarted while the volume
/// is published and under writes (they pause, none fails); online expansion grows the file
/// system `df` sees; DeleteVolume removes the device and the backing file.
#[tokio::test]
async fn the_kubelets_path_keeps_data_across_restages_and_a_ublkd_crash() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let mut pair = Pair::start("csi-kubelet", 9564, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-kubelet", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id.clone();
    ensure!(
        id == "pvc-kubelet" && vol.capacity_bytes == (64 * MIB) as i64,
        "{vol:?}"
    );
    ensure!(
        vol.accessible_topology[0]
            .segments
            .get("ublkd.io/node")
            .map(String::as_str)
            == Some("node-a"),
        "topology: {vol:?}"
    );
    // Idempotent on name; a different size is ALREADY_EXISTS.
    let again = ctl
        .create_volume(create("pvc-kubelet", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner();
    ensure!(again.volume.map(|v| v.volume_id) == Some(id.clone()));
    let e = ctl
        .create_volume(create("pvc-kubelet", 256 * MIB, &params, cap.clone()))
        .await
        .expect_err("a different size");
    ensure!(e.code() == tonic::Code::AlreadyExists, "{e:?}");

    let staging = pair
        .kubelet
        .join("plugins/ublkd.io/globalmount/pvc-kubelet");
    let t1 = pair.kubelet.join("pods/a/volumes/pvc-kubelet");
    let t2 = pair.kubelet.join("pods/b/volumes/pvc-kubelet");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage is idempotent")?;
    for t in [&t1, &t2] {
        node.node_publish_volume(publish(&id, &staging, t, cap.clone()))
            .await?;
    }
    guest::sh(&format!("echo through-a > {}/data && sync", t1.display()))?;
    ensure!(
        guest::sh(&format!("cat {}/data", t2.display()))?.trim() == "through-a",
        "both targets show the same file system"
    );

    // kill -9 under writes: they pause while ublkd is gone and resume on the new one.
    let writer = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "for i in $(seq 1 40); do dd if=/dev/urandom of={}/w bs=64k count=4 conv=fsync \
             status=none || exit 1; sleep 0.1; done",
            t1.display()
        ))
        .spawn()?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    pair.daemon.stop_with(9)?;
    pair.daemon.start().await?;
    let status = tokio::task::spawn_blocking(move || {
        let mut w = writer;
        w.wait()
    })
    .await??;
    ensure!(status.success(), "writes failed across the ublkd restart");

    for t in [&t1, &t2] {
        node.node_unpublish_volume(unpublish(&id, t)).await?;
        ensure!(!t.exists(), "{} removed", t.display());
    }
    node.node_unpublish_volume(unpublish(&id, &t1))
        .await
        .context("unpublish is idempotent")?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ensure!(!is_mountpoint(&staging), "unstaged");
    // Data survives: stage and publish again.
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish(&id, &staging, &t1, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/data", t1.display()))?.trim() == "through-a",
        "the data is there after unstage and restage"
    );

    // Online expansion: ublkd grows the device, the driver the file system.
    let before = fs_bytes(&t1)?;
    let grown = node
        .node_expand_volume(spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: (128 * MIB) as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        })
        .await?
        .into_inner();
    let after = fs_bytes(&t1)?;
    println!(
        "expand: {before} -> {after} bytes (capacity {})",
        grown.capacity_bytes
    );
    ensure!(grown.capacity_bytes == (128 * MIB) as i64);
    ensure!(after > before + 48 * MIB, "df grew: {before} -> {after}");
    // A range that asks nothing keeps the size; it is not a new volume's default size.
    let kept = node
        .node_expand_volume(spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: 0,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        })
        .await?
        .into_inner();
    ensure!(
        kept.capacity_bytes == (128 * MIB) as i64,
        "an empty range kept the size: {}",
        kept.capacity_bytes
    );
    let stats = node
        .node_get_volume_stats(spec::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            staging_target_path: String::new(),
        })
        .await?
        .into_inner();
    ensure!(
        stats.volume_condition.as_ref().is_some_and(|c| !c.abnormal),
        "{stats:?}"
    );
    ensure!(stats.usage.len() == 2, "bytes and inodes: {stats:?}");

    // The volume's delete can come while it is still staged (the kubelet unstages after the
    // pod is gone, and nothing orders the two): the delete waits, and the device stays while
    // anything holds it, here and in a mount namespace ublkd cannot see (as the driver's pod
    // is to ublkd's); once both let go, the delete completes.
    let dev_path = pair.daemon.ublkctl_ok(&["get-volume", &id, "-o", "json"])?;
    let dev_path = serde_json::from_str::<serde_json::Value>(&dev_path)?["device_path"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let deleting = {
        let (mut ctl, id) = (ctl.clone(), id.clone());
        tokio::spawn(async move {
            ctl.delete_volume(spec::DeleteVolumeRequest {
                volume_id: id,
                secrets: Default::default(),
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        !deleting.is_finished() && Path::new(&dev_path).exists(),
        "the delete of a staged volume returned (or removed its device) before it was unstaged"
    );
    let elsewhere = pair.kubelet.join("other-namespace");
    std::fs::create_dir_all(&elsewhere)?;
    let mut holder = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount {dev_path} {} && echo mounted && sleep 4",
            elsewhere.display()
        ))
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    {
        use std::io::BufRead;
        let out = holder.stdout.take().context("unshare stdout")?;
        std::io::BufReader::new(out).read_line(&mut line)?;
    }
    ensure!(
        line.trim() == "mounted",
        "the other namespace mounted it: {line:?}"
    );
    ensure!(!is_mountpoint(&elsewhere), "not visible in this namespace");
    node.node_unpublish_volume(unpublish(&id, &t1)).await?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        !deleting.is_finished() && Path::new(&dev_path).exists(),
        "the delete returned (or removed the device) while another namespace held it"
    );
    deleting
        .await
        .context("the delete's task")?
        .context("the delete once the volume was let go")?;
    ensure!(
        holder.try_wait()?.is_some(),
        "the delete completed while the other namespace still held the device"
    );
    ensure!(!Path::new(&dev_path).exists(), "{dev_path} removed");
    let backing = pair.daemon.root.join(format!("{id}.img"));
    ensure!(!backing.exists(), "{} removed", backing.display());
    ctl.delete_volume(spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await
    .context("delete is idempotent")?;
    Ok(())
}
