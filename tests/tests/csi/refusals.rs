//! Bad requests are refused and change nothing.

use super::{ensure, file_params, guest, kubelet, Context, Pair, Path, Result, MIB};

/// Bad requests get the code the spec gives them, and nothing is created or mounted.
#[tokio::test]
async fn bad_csi_requests_are_refused_and_change_nothing() -> Result<()> {
    use kubelet::*;
    use spec::volume_capability::access_mode::Mode;
    use tonic::Code;
    use ublkd_csi::spec;
    let pair = Pair::start("csi-bad", 9567, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let mounts_before = std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .count();
    let mut cases: Vec<(&str, Code, Result<(), tonic::Status>)> = Vec::new();
    let mut add = |what, code, r: Result<(), tonic::Status>| cases.push((what, code, r));

    let mut r = create("", 16 * MIB, &params, mount_cap("ext4"));
    add(
        "no name",
        Code::InvalidArgument,
        ctl.create_volume(r.clone()).await.map(drop),
    );
    r.name = "pvc-bad".into();
    r.volume_capabilities.clear();
    add(
        "no capabilities",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let mut unknown = params.clone();
    unknown.push(("fstype", "ext4".into()));
    let r = create("pvc-bad", 16 * MIB, &unknown, mount_cap("ext4"));
    add(
        "unknown parameter",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let r = create("pvc-bad", 16 * MIB, &[], mount_cap("ext4"));
    add(
        "no backend",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    for mode in [
        Mode::MultiNodeMultiWriter,
        Mode::MultiNodeReaderOnly,
        Mode::MultiNodeSingleWriter,
    ] {
        let r = create("pvc-bad", 16 * MIB, &params, block_cap(mode));
        add(
            "multi-node mode",
            Code::InvalidArgument,
            ctl.create_volume(r).await.map(drop),
        );
    }
    let r = create("pvc-bad", 16 * MIB, &params, mount_cap("btrfs"));
    add(
        "unknown file system",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let mut r = create("pvc-bad", 16 * MIB, &params, mount_cap("ext4"));
    r.capacity_range = Some(spec::CapacityRange {
        required_bytes: 5000,
        limit_bytes: 4097,
    });
    add(
        "limit below the size",
        Code::OutOfRange,
        ctl.create_volume(r).await.map(drop),
    );
    add(
        "delete without id",
        Code::InvalidArgument,
        ctl.delete_volume(spec::DeleteVolumeRequest::default())
            .await
            .map(drop),
    );

    // A real volume for the node-side cases.
    let id = ctl
        .create_volume(create("pvc-good", 16 * MIB, &params, mount_cap("ext4")))
        .await?
        .into_inner()
        .volume
        .context("volume")?
        .volume_id;
    let staging = pair.kubelet.join("staging/pvc-good");
    let target = pair.kubelet.join("pods/x/pvc-good");
    std::fs::create_dir_all(&staging)?;
    let cap = mount_cap("ext4");
    let mut s = stage(&id, &staging, cap.clone());
    s.volume_id.clear();
    add(
        "stage without id",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let mut s = stage(&id, &staging, cap.clone());
    s.staging_target_path.clear();
    add(
        "stage without path",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let mut s = stage(&id, &staging, cap.clone());
    s.volume_capability = None;
    add(
        "stage without capability",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let s = stage(&id, Path::new("/tmp/outside-kubelet"), cap.clone());
    add(
        "staging outside kubelet dir",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let s = stage("pvc-missing", &staging, cap.clone());
    add(
        "stage of a missing volume",
        Code::NotFound,
        node.node_stage_volume(s).await.map(drop),
    );
    let p = publish(&id, &staging, Path::new("/etc/ublkd-csi-test"), cap.clone());
    add(
        "target outside kubelet dir",
        Code::InvalidArgument,
        node.node_publish_volume(p).await.map(drop),
    );
    // A volume holding ext4 is never formatted as xfs: staging it so is refused, and the
    // file system and its data stay.
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!("echo kept > {}/kept", staging.display()))?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    let s = stage(&id, &staging, mount_cap("xfs"));
    add(
        "staging ext4 as xfs",
        Code::FailedPrecondition,
        node.node_stage_volume(s).await.map(drop),
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/kept", staging.display()))?.trim() == "kept",
        "the data is still there"
    );
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    // Another file system already mounted at the staging path.
    guest::sh(&format!("mount -t tmpfs other {}", staging.display()))?;
    let s = stage(&id, &staging, cap.clone());
    add(
        "staging path taken",
        Code::AlreadyExists,
        node.node_stage_volume(s).await.map(drop),
    );
    guest::sh(&format!("umount {}", staging.display()))?;
    let mounts_after = std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .count();

    let mut wrong = Vec::new();
    for (what, code, r) in &cases {
        match r {
            Err(s) if s.code() == *code => println!("ok      {what}: {}", s.message()),
            other => wrong.push(format!("{what}: wanted {code:?}, got {other:?}")),
        }
    }
    ensure!(wrong.is_empty(), "{wrong:#?}");
    ensure!(cases.len() >= 18, "{} cases", cases.len());
    ensure!(
        mounts_before == mounts_after,
        "mounts changed: {mounts_before} -> {mounts_after}"
    );
    ensure!(!target.exists(), "nothing published");
    let list = pair.daemon.ublkctl_ok(&["list-volumes", "--no-headers"])?;
    ensure!(
        list.lines().count() == 1 && list.contains("pvc-good"),
        "only the good volume exists: {list}"
    );
    ctl.delete_volume(spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}
