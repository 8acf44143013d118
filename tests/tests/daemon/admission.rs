//! Volumes are admitted within ublkd's cgroup memory limit.

use super::{
    api, create, ensure, guest, spec, v1, Backend, Code, Context, Daemon, Duration, Path, Result,
    MIB,
};

/// ublkd in a cgroup with a memory limit (as a pod with `resources.limits.memory`) admits
/// volumes within it: each may hold its copy buffers (queues × depth × 512 KiB) and a RAM
/// volume its pages; past the limit a create is RESOURCE_EXHAUSTED naming it (never an OOM kill
/// that stalls every volume), RAM capacity offers no more than is left, and a delete frees it.
#[tokio::test]
async fn volumes_are_admitted_within_the_cgroup_memory_limit() -> Result<()> {
    let dir = guest::scratch("daemon-memory")?;
    let cgroups = Path::new("/sys/fs/cgroup");
    if !cgroups.join("cgroup.controllers").exists() {
        guest::sh("mount -t cgroup2 none /sys/fs/cgroup")?;
    }
    guest::sh("echo +memory > /sys/fs/cgroup/cgroup.subtree_control")?;
    let cg = cgroups.join("ublkd-memory-test");
    std::fs::create_dir_all(&cg)?;
    // ublkd's reserve (256 MiB) and 64 MiB for volumes
    std::fs::write(cg.join("memory.max"), format!("{}", 320 * MIB))?;
    let mut d = Daemon::new(&dir, 19624, "")?;
    d.cgroup = Some(cg.clone());
    d.start().await?;
    let mut node = d.node().await?;
    let ram_cap = v1::GetCapacityRequest {
        backend: Some(v1::get_capacity_request::Backend::Ram(v1::RamBackend {})),
    };
    let cap = node.get_capacity(ram_cap.clone()).await?.into_inner();
    println!(
        "RAM capacity under the limit: {} bytes",
        cap.available_bytes
    );
    ensure!(cap.available_bytes <= 64 * MIB, "{cap:?}");
    let mut vols = d.volumes().await?;
    // 32 tags: 16 MiB of copy buffers each; the RAM volume 32 MiB more: 64 MiB in all
    vols.create_volume(create(
        "mem-a",
        spec(64 * MIB, Backend::Null(v1::NullBackend {})),
    ))
    .await?;
    vols.create_volume(create("mem-b", spec(32 * MIB, api::ram())))
        .await?;
    let cap = node.get_capacity(ram_cap).await?.into_inner();
    ensure!(cap.available_bytes == 0, "RAM still offered: {cap:?}");
    let refused = vols
        .create_volume(create(
            "mem-c",
            spec(64 * MIB, Backend::Null(v1::NullBackend {})),
        ))
        .await;
    let e = refused
        .err()
        .context("a create past the memory limit was admitted")?;
    println!("past the limit: {e}");
    ensure!(
        e.code() == Code::ResourceExhausted && e.message().contains("memory limit"),
        "{e}"
    );
    vols.delete_volume(v1::DeleteVolumeRequest {
        id: "mem-a".into(),
        ..Default::default()
    })
    .await?;
    vols.create_volume(create(
        "mem-c",
        spec(64 * MIB, Backend::Null(v1::NullBackend {})),
    ))
    .await?;
    for id in ["mem-b", "mem-c"] {
        vols.delete_volume(v1::DeleteVolumeRequest {
            id: id.into(),
            ..Default::default()
        })
        .await?;
    }
    // ublkd's graceful stop waits for its clients' connections, closed by this runtime
    drop((vols, node));
    tokio::time::sleep(Duration::from_millis(500)).await;
    d.stop_with(libc::SIGTERM)?;
    // the cgroup goes once ublkd has left it
    std::fs::remove_dir(&cg)?;
    Ok(())
}
