//! Staging never formats a device it could not read, to its end.

use super::{
    bail, ensure, file_params, guest, kubelet, Context, Duration, Instant, Pair, Result, MIB,
};

/// A device that fails its reads is never formatted (issue 22, item 1): an ext4 volume with
/// files is unstaged, its backing file's reads fail (hook; writes still go through), and the
/// next stage is refused as UNAVAILABLE with nothing written; once reads work again, stage
/// mounts the same file system (same UUID) with the files intact.
#[tokio::test]
async fn stage_never_formats_a_device_it_could_not_read() -> Result<()> {
    use kubelet::*;
    let dir = guest::scratch("csi-stage-eio-faults")?;
    let faults = dir.join("faults");
    let pair = Pair::start_env(
        "csi-stage-eio",
        9570,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS_FILE", &faults.to_string_lossy())],
    )
    .await?;
    let arm = |spec: &str| -> Result<()> {
        std::fs::write(&faults, spec)?;
        let pid = pair.daemon.pid().context("ublkd is not running")?;
        guest::sh(&format!("kill -USR2 {pid}"))?;
        Ok(())
    };
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-eio", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id;
    let staging = pair.kubelet.join("plugins/ublkd.io/globalmount/pvc-eio");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!(
        "echo tenant-data > {s}/keep && dd if=/dev/urandom of={s}/blob bs=64k count=16          status=none && sync",
        s = staging.display()
    ))?;
    let sum = guest::sh(&format!("md5sum < {}/blob", staging.display()))?;
    let dev = guest::sh(&format!("findmnt -n -o SOURCE {}", staging.display()))?;
    let dev = dev.trim().to_owned();
    let uuid = || guest::sh(&format!("blkid -p -o value -s UUID {dev}"));
    let before = uuid()?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;

    arm("file_read_eio=100000000")?;
    // The fault is armed once a direct read of the device fails.
    let deadline = Instant::now() + Duration::from_secs(10);
    while guest::sh(&format!(
        "dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none"
    ))
    .is_ok()
    {
        ensure!(
            Instant::now() < deadline,
            "the read fault never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = node
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .expect_err("a device that cannot be read is not staged");
    println!("stage while reads fail: {e:?}");
    ensure!(e.code() == tonic::Code::Unavailable, "{e:?}");
    ensure!(!is_mountpoint(&staging), "nothing mounted");
    arm("file_read_eio=0")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while guest::sh(&format!(
        "dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none"
    ))
    .is_err()
    {
        ensure!(Instant::now() < deadline, "the read fault never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        uuid()? == before,
        "the file system was replaced while reads failed: UUID {before} became {}",
        uuid()?
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage once reads work again")?;
    ensure!(
        guest::sh(&format!("cat {}/keep", staging.display()))?.trim() == "tenant-data",
        "the tenant's file is intact"
    );
    ensure!(guest::sh(&format!("md5sum < {}/blob", staging.display()))? == sum);
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ctl.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}

/// A live file system whose end cannot be read is never formatted (issue 38, defect 3): blkid
/// probes the device's end too, and a read error there makes it answer as it does for a blank
/// device ("nothing found", exit 2), while the head reads fine. An ext4 volume with a file is
/// unstaged, reads of its last MiB fail (hook; the rest of it reads), and the next stage is
/// refused with nothing written; once reads work again, the file system (same UUID) and its
/// file are intact.
#[tokio::test]
async fn stage_never_formats_a_device_whose_end_cannot_be_read() -> Result<()> {
    use kubelet::*;
    const SIZE: u64 = 64 * MIB;
    let dir = guest::scratch("csi-stage-end-eio-faults")?;
    let faults = dir.join("faults");
    let pair = Pair::start_env(
        "csi-stage-end-eio",
        9573,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS_FILE", &faults.to_string_lossy())],
    )
    .await?;
    let arm = |spec: &str| -> Result<()> {
        std::fs::write(&faults, spec)?;
        let pid = pair.daemon.pid().context("ublkd is not running")?;
        guest::sh(&format!("kill -USR2 {pid}"))?;
        Ok(())
    };
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-end-eio", SIZE, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id;
    let staging = pair
        .kubelet
        .join("plugins/ublkd.io/globalmount/pvc-end-eio");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!(
        "echo tenant-data > {}/keep && sync",
        staging.display()
    ))?;
    let dev = guest::sh(&format!("findmnt -n -o SOURCE {}", staging.display()))?;
    let dev = dev.trim().to_owned();
    let uuid = || -> Result<String> {
        Ok(guest::sh(&format!("blkid -p -o value -s UUID {dev}"))?
            .trim()
            .to_owned())
    };
    let before = uuid()?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;

    // Reads of the last MiB fail, and only those.
    arm(&format!("file_read_eio=100000000:{}+{MIB}", SIZE - MIB))?;
    let read_at = |block: u64| {
        guest::sh(&format!(
            "dd if={dev} of=/dev/null bs=4k skip={block} count=1 iflag=direct status=none"
        ))
    };
    let last = SIZE / 4096 - 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_at(last).is_ok() {
        ensure!(
            Instant::now() < deadline,
            "the read fault never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    read_at(0).context("the head still reads")?;
    read_at(last - 256).context("the MiB before the last still reads")?;
    // Nothing of the device stays cached from before: blkid reads it now.
    guest::sh(&format!("blockdev --flushbufs {dev}"))?;
    println!(
        "blkid while the end fails: {}",
        guest::sh(&format!("blkid -p {dev}; echo exit $?"))?.trim()
    );
    let staged = node
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await;
    arm("file_read_eio=0")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_at(last).is_err() {
        ensure!(Instant::now() < deadline, "the read fault never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = uuid()?;
    match staged {
        Ok(_) => bail!(
            "stage succeeded while the end of the device failed to read: the file system was \
             {}, UUID {before} became {after}",
            if after == before { "kept" } else { "formatted" }
        ),
        Err(e) => {
            println!("stage while the end fails: {e:?}");
            ensure!(
                matches!(
                    e.code(),
                    tonic::Code::Unavailable | tonic::Code::FailedPrecondition
                ),
                "{e:?}"
            );
            ensure!(e.message().contains("last MiB"), "{e:?}");
        }
    }
    ensure!(!is_mountpoint(&staging), "nothing mounted");
    ensure!(
        after == before,
        "the file system was replaced while its end failed to read: UUID {before} became {after}"
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage once reads work again")?;
    ensure!(
        guest::sh(&format!("cat {}/keep", staging.display()))?.trim() == "tenant-data",
        "the tenant's file is intact"
    );
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ctl.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}
