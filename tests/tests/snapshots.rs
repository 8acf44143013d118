//! Snapshots and clones of file volumes in the guest, on a real XFS with reflink (a loop device
//! over a file in the guest's tmpfs), and the refusal on ext4.
#![cfg(feature = "vm")]

use anyhow::{ensure, Result};
use std::path::Path;
use std::time::Instant;
use tonic::Code;
use ublkd_proto::v1::{self, volume_spec::Source};
use ublkd_tests::api::{self, create, file, volume as spec};
use ublkd_tests::daemon::Daemon;
use ublkd_tests::guest;
use ublkd_tests::MIB;

/// Makes a `size` file system of `kind` on a loop device over a sparse file and mounts it at
/// `at`; returns the loop device.
fn loop_fs(dir: &Path, name: &str, kind: &str, size: u64, at: &Path) -> Result<String> {
    let img = guest::backing_file(dir, &format!("{name}.fsimg"), size)?;
    guest::sh("modprobe loop 2>/dev/null || true")?;
    let dev = guest::sh(&format!("losetup --find --show {}", img.display()))?;
    let dev = dev.trim().to_owned();
    let mkfs = match kind {
        "xfs" => format!("mkfs.xfs -q -f -m reflink=1 {dev}"),
        _ => format!("mkfs.ext4 -q -F {dev}"),
    };
    guest::sh(&mkfs)?;
    std::fs::create_dir_all(at)?;
    guest::sh(&format!("mount {dev} {}", at.display()))?;
    Ok(dev)
}

/// Bytes in use on the file system holding `path`.
fn used(path: &Path) -> Result<u64> {
    let out = guest::sh(&format!(
        "df --output=used -B1 {} | tail -1",
        path.display()
    ))?;
    Ok(out.trim().parse()?)
}

/// Writes (or, with `check`, verifies) the byte `pattern` over the whole of `dev`.
fn pattern(dev: &str, byte: u8, check: bool) -> Result<()> {
    let pat = format!("--verify_pattern=0x{byte:02x}");
    let mut args = vec![
        "--rw=write",
        "--bs=1M",
        "--verify=pattern",
        &pat,
        "--do_verify=0",
    ];
    if check {
        args.push("--verify_only");
    }
    guest::fio(Path::new(dev), &args)?;
    Ok(())
}

type Client = v1::volume_service_client::VolumeServiceClient<tonic::transport::Channel>;

async fn device_of(c: &mut Client, id: &str) -> Result<String> {
    Ok(c.get_volume(v1::GetVolumeRequest { id: id.into() })
        .await?
        .into_inner()
        .device_path)
}

fn from(src: Source, path: &Path, size: u64) -> v1::VolumeSpec {
    let mut s = spec(size, file(path, true));
    s.source = Some(src);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_clones_by_reflink_are_instant_shared_and_point_in_time() -> Result<()> {
    let dir = guest::scratch("snap")?;
    let mut d = Daemon::new(&dir, 19612, "")?;
    let xfs = loop_fs(&dir, "xfs", "xfs", 2048 * MIB, &d.root)?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let root = d.root.clone();

    // Pattern A, snapshot, pattern B; the clone of the snapshot reads A, the origin B.
    c.create_volume(create(
        "origin",
        spec(64 * MIB, file(&root.join("origin.img"), true)),
    ))
    .await?;
    let origin = device_of(&mut c, "origin").await?;
    pattern(&origin, 0xaa, false)?;
    let before = used(&root)?;
    let t = Instant::now();
    let snap = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "snap-a".into(),
            source_volume_id: "origin".into(),
        })
        .await?
        .into_inner();
    println!("snapshot of 64 MiB: {:?}", t.elapsed());
    ensure!(snap.ready && snap.size_bytes == 64 * MIB, "{snap:?}");
    let grew = used(&root)?.saturating_sub(before);
    println!("file system use grew by {grew} bytes for a 64 MiB snapshot");
    ensure!(grew < 4 * MIB, "the snapshot took {grew} bytes: not shared");
    // Idempotent by id; another volume under the same id is refused.
    let again = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "snap-a".into(),
            source_volume_id: "origin".into(),
        })
        .await?
        .into_inner();
    assert_eq!(again.created, snap.created);
    pattern(&origin, 0xbb, false)?;
    let before = used(&root)?;
    let t = Instant::now();
    c.create_volume(create(
        "clone-a",
        from(
            Source::FromSnapshot("snap-a".into()),
            &root.join("clone-a.img"),
            64 * MIB,
        ),
    ))
    .await?;
    println!("clone of a 64 MiB snapshot: {:?}", t.elapsed());
    let grew = used(&root)?.saturating_sub(before);
    ensure!(grew < 4 * MIB, "the clone took {grew} bytes: not shared");
    pattern(&device_of(&mut c, "clone-a").await?, 0xaa, true)?;
    pattern(&origin, 0xbb, true)?;
    // A clone of the live volume (drained for the clone) reads what it had: B; it may be
    // larger than its source.
    c.create_volume(create(
        "clone-b",
        from(
            Source::FromVolume("origin".into()),
            &root.join("clone-b.img"),
            128 * MIB,
        ),
    ))
    .await?;
    let clone_b = device_of(&mut c, "clone-b").await?;
    guest::fio(
        Path::new(&clone_b),
        &[
            "--rw=write",
            "--bs=1M",
            "--size=64M",
            "--verify=pattern",
            "--verify_pattern=0xbb",
            "--do_verify=0",
            "--verify_only",
        ],
    )?;

    // A mounted XFS under fio randwrite: the snapshot's clone mounts and passes xfs_repair -n.
    c.create_volume(create(
        "busy",
        spec(512 * MIB, file(&root.join("busy.img"), true)),
    ))
    .await?;
    let busy = device_of(&mut c, "busy").await?;
    let mnt = dir.join("busy-mnt");
    std::fs::create_dir_all(&mnt)?;
    guest::sh(&format!(
        "mkfs.xfs -q -f {busy} && mount {busy} {}",
        mnt.display()
    ))?;
    let target = mnt.join("data");
    let load = std::thread::spawn(move || {
        guest::fio(
            &target,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--size=64M",
                "--iodepth=16",
                "--time_based",
                "--runtime=4",
            ],
        )
    });
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    c.create_snapshot(v1::CreateSnapshotRequest {
        id: "snap-busy".into(),
        source_volume_id: "busy".into(),
    })
    .await?;
    load.join().expect("fio thread")?;
    c.create_volume(create(
        "clone-busy",
        from(
            Source::FromSnapshot("snap-busy".into()),
            &root.join("clone-busy.img"),
            512 * MIB,
        ),
    ))
    .await?;
    let cb = device_of(&mut c, "clone-busy").await?;
    let cmnt = dir.join("clone-mnt");
    std::fs::create_dir_all(&cmnt)?;
    // Mounting replays the log (crash-consistent, like a power cut); nouuid: the origin with
    // the same UUID is mounted.
    guest::sh(&format!(
        "mount -o nouuid {cb} {0} && ls -la {0} && umount {0} && xfs_repair -n {cb}",
        cmnt.display()
    ))?;
    guest::sh(&format!("umount {}", mnt.display()))?;

    // Listing, filters, restart (records are durable), delete.
    let list = |source: &str| v1::ListSnapshotsRequest {
        id: String::new(),
        source_volume_id: source.into(),
    };
    let all = c.list_snapshots(list("")).await?.into_inner().snapshots;
    assert_eq!(all.len(), 2, "{all:?}");
    let of_busy = c.list_snapshots(list("busy")).await?.into_inner().snapshots;
    assert_eq!(of_busy.len(), 1);
    assert_eq!(of_busy[0].id, "snap-busy");
    d.stop_with(libc::SIGKILL)?;
    d.start().await?;
    d.wait_all_ready().await?;
    let mut c = d.volumes().await?;
    let all = c.list_snapshots(list("")).await?.into_inner().snapshots;
    assert_eq!(all.len(), 2, "snapshots survive kill -9: {all:?}");
    for s in &all {
        c.delete_snapshot(v1::DeleteSnapshotRequest {
            id: s.id.clone(),
            allow_missing: false,
        })
        .await?;
        ensure!(!Path::new(&s.path).exists(), "{} left behind", s.path);
    }
    // The clone does not depend on its snapshot.
    pattern(&device_of(&mut c, "clone-a").await?, 0xaa, true)?;
    let gone = c
        .delete_snapshot(v1::DeleteSnapshotRequest {
            id: "snap-a".into(),
            allow_missing: false,
        })
        .await
        .expect_err("deleted twice");
    assert_eq!(gone.code(), Code::NotFound);

    // Refusals: ext4 cannot reflink (nothing copied), a RAM volume has no file.
    let ext4_dir = root.join("ext4");
    let ext4 = loop_fs(&dir, "ext4", "ext4", 64 * MIB, &ext4_dir)?;
    c.create_volume(create(
        "on-ext4",
        spec(16 * MIB, file(&ext4_dir.join("v.img"), true)),
    ))
    .await?;
    let e = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "snap-ext4".into(),
            source_volume_id: "on-ext4".into(),
        })
        .await
        .expect_err("ext4 cannot reflink");
    println!("ext4: {}", e.message());
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    ensure!(
        e.message().contains("ext4") && e.message().contains("cannot reflink"),
        "{}",
        e.message()
    );
    let left = std::fs::read_dir(ext4_dir.join(".ublkd-snapshots"))?.count();
    assert_eq!(left, 0, "a refused snapshot leaves no file");
    c.create_volume(create("ram", spec(16 * MIB, api::ram())))
        .await?;
    let e = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "snap-ram".into(),
            source_volume_id: "ram".into(),
        })
        .await
        .expect_err("ram has no file");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    for v in c
        .list_volumes(v1::ListVolumesRequest {})
        .await?
        .into_inner()
        .volumes
    {
        c.delete_volume(v1::DeleteVolumeRequest {
            id: v.id,
            ..Default::default()
        })
        .await?;
    }
    let st = d.stop_with(libc::SIGTERM)?;
    assert!(st.success(), "clean exit: {st}\n{}", d.log());
    guest::sh(&format!(
        "umount {0}/ext4; umount {0}; losetup -d {ext4} {xfs}",
        root.display()
    ))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_is_never_confirmed_fails_the_snapshot_and_resumes_the_volume() -> Result<()> {
    let dir = guest::scratch("snap-drain")?;
    let mut d = Daemon::new(&dir, 19614, "")?;
    // The first drain a worker is asked for is never confirmed.
    d.env = vec![("UBLKD_TEST_FAULTS".into(), "drain_unanswered=1".into())];
    let fs = loop_fs(&dir, "xfs", "xfs", 512 * MIB, &d.root)?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let img = d.root.join("v.img");
    c.create_volume(create("v", spec(64 * MIB, file(&img, true))))
        .await?;
    let dev = device_of(&mut c, "v").await?;
    pattern(&dev, 0x5a, false)?;
    // Writes in flight while the drain fails: the requests it held must be served.
    let writer = dev.clone();
    let load = std::thread::spawn(move || {
        guest::fio(
            Path::new(&writer),
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=32M",
                "--offset=32M",
                "--verify=crc32c",
                "--time_based",
                "--runtime=3",
            ],
        )
    });
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let e = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "s".into(),
            source_volume_id: "v".into(),
        })
        .await
        .expect_err("the drain was never confirmed");
    println!("snapshot: {:?} {}", e.code(), e.message());
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    ensure!(e.message().contains("resumed"), "{}", e.message());
    load.join().expect("fio thread")?;
    // Nothing of the snapshot is left, and the volume still reads what it had.
    let listed = c
        .list_snapshots(v1::ListSnapshotsRequest::default())
        .await?
        .into_inner()
        .snapshots;
    assert!(listed.is_empty(), "{listed:?}");
    let left = std::fs::read_dir(d.root.join(".ublkd-snapshots"))?.count();
    assert_eq!(left, 0, "a failed snapshot leaves no file");
    guest::fio(
        Path::new(&dev),
        &[
            "--rw=write",
            "--bs=1M",
            "--size=32M",
            "--verify=pattern",
            "--verify_pattern=0x5a",
            "--do_verify=0",
            "--verify_only",
        ],
    )?;
    // The next snapshot (the fault spent) is taken.
    c.create_snapshot(v1::CreateSnapshotRequest {
        id: "s".into(),
        source_volume_id: "v".into(),
    })
    .await?;
    c.delete_volume(v1::DeleteVolumeRequest {
        id: "v".into(),
        ..Default::default()
    })
    .await?;
    let st = d.stop_with(libc::SIGTERM)?;
    assert!(st.success(), "clean exit: {st}\n{}", d.log());
    guest::sh(&format!("umount {}; losetup -d {fs}", d.root.display()))?;
    Ok(())
}

/// Deletes `volumes` (with their files) and `snapshots`, stops ublkd cleanly and takes the loop
/// file system `fs` at its root away.
async fn tear_down(
    d: &mut Daemon,
    c: &mut Client,
    volumes: &[&str],
    snapshots: &[&str],
    fs: &str,
) -> Result<()> {
    for id in volumes {
        c.delete_volume(v1::DeleteVolumeRequest {
            id: (*id).into(),
            delete_backing: true,
            ..Default::default()
        })
        .await?;
    }
    for id in snapshots {
        c.delete_snapshot(v1::DeleteSnapshotRequest {
            id: (*id).into(),
            ..Default::default()
        })
        .await?;
    }
    let st = d.stop_with(libc::SIGTERM)?;
    ensure!(st.success(), "clean exit: {st}\n{}", d.log());
    guest::sh(&format!("umount {}; losetup -d {fs}", d.root.display()))?;
    Ok(())
}

/// Until ublkd, which a fault point aborted, has exited.
async fn wait_exit(d: &mut Daemon) -> Result<()> {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while d.exited()?.is_none() {
        ensure!(
            Instant::now() < deadline,
            "ublkd did not exit at its fault point"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Ok(())
}

/// A snapshot or a clone that dies between its reflink and its record leaves nothing that
/// blocks a retry (issue 22, item 6): ublkd is killed at each point by a fault point, restarted,
/// and the retry of the same id succeeds, with no stray file beside the volumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_or_clone_killed_before_its_record_is_retried_and_leaves_no_file() -> Result<()>
{
    let dir = guest::scratch("snap-interrupted")?;
    let mut d = Daemon::new(&dir, 19621, "")?;
    let fs = loop_fs(&dir, "xfs", "xfs", 512 * MIB, &d.root)?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let img = d.root.join("v.img");
    c.create_volume(create("v", spec(64 * MIB, file(&img, true))))
        .await?;
    let dev = device_of(&mut c, "v").await?;
    pattern(&dev, 0x3c, false)?;
    let files = |root: &Path| -> Result<Vec<String>> {
        let out = guest::sh(&format!("cd {} && find . -type f | sort", root.display()))?;
        Ok(out.lines().map(str::to_owned).collect())
    };

    // Snapshot: dies after the reflink, before the record.
    d.stop_with(libc::SIGTERM)?;
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "abort_at=snapshot:after_reflink".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    let died = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "s1".into(),
            source_volume_id: "v".into(),
        })
        .await;
    ensure!(
        died.is_err(),
        "the fault point did not stop ublkd: {died:?}"
    );
    wait_exit(&mut d).await?;
    println!("after the interrupted snapshot: {:?}", files(&d.root)?);
    d.env.clear();
    d.start().await?;
    let mut c = d.volumes().await?;
    let snap = c
        .create_snapshot(v1::CreateSnapshotRequest {
            id: "s1".into(),
            source_volume_id: "v".into(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("the retry of the interrupted snapshot: {e:?}"))?
        .into_inner();
    ensure!(snap.source_volume_id == "v", "{snap:?}");

    // Clone: dies after the reflink, before the volume's record.
    d.stop_with(libc::SIGTERM)?;
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "abort_at=clone:after_reflink".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    let clone_img = d.root.join("c.img");
    let died = c
        .create_volume(create(
            "c",
            from(Source::FromVolume("v".into()), &clone_img, 64 * MIB),
        ))
        .await;
    ensure!(
        died.is_err(),
        "the fault point did not stop ublkd: {died:?}"
    );
    wait_exit(&mut d).await?;
    println!("after the interrupted clone: {:?}", files(&d.root)?);
    d.env.clear();
    d.start().await?;
    let mut c = d.volumes().await?;
    c.create_volume(create(
        "c",
        from(Source::FromVolume("v".into()), &clone_img, 64 * MIB),
    ))
    .await
    .map_err(|e| anyhow::anyhow!("the retry of the interrupted clone: {e:?}"))?;
    let clone_dev = device_of(&mut c, "c").await?;
    pattern(&clone_dev, 0x3c, true)?;

    // Only the volumes' files and the one snapshot's copy: nothing stray.
    let left = files(&d.root)?;
    println!("files: {left:?}");
    let expected = vec![
        "./.ublkd-snapshots/s1.img".to_owned(),
        "./c.img".to_owned(),
        "./v.img".to_owned(),
    ];
    ensure!(left == expected, "stray files: {left:?}");
    tear_down(&mut d, &mut c, &["c", "v"], &["s1"], &fs).await
}

/// What GetCapacity says is available under `root`.
async fn available(d: &Daemon, root: &str) -> Result<u64> {
    let req = v1::GetCapacityRequest {
        backend: Some(v1::get_capacity_request::Backend::File(v1::FileCapacity {
            root: root.to_owned(),
        })),
    };
    Ok(d.node()
        .await?
        .get_capacity(req)
        .await?
        .into_inner()
        .available_bytes)
}

/// Capacity counts what each file volume may still allocate, blocks it shares by reflink
/// included (issue 22, item 9): once a snapshot shares a volume's written blocks, rewriting
/// them needs new space, so the node's available bytes drop by about what was written; a clone
/// shares all of its source's and drops them by its written size again. Checked on a real XFS
/// with reflink, never against the size of the file system alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_counts_blocks_shared_with_snapshots_and_clones() -> Result<()> {
    let dir = guest::scratch("snap-capacity")?;
    let mut d = Daemon::new(&dir, 19622, "")?;
    let fs = loop_fs(&dir, "xfs", "xfs", 512 * MIB, &d.root)?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let root = d.root.display().to_string();
    let img = d.root.join("v.img");
    c.create_volume(create("v", spec(64 * MIB, file(&img, true))))
        .await?;
    let dev = device_of(&mut c, "v").await?;
    // 32 MiB written of the 64.
    guest::sh(&format!(
        "dd if=/dev/urandom of={dev} bs=1M count=32 oflag=direct status=none"
    ))?;
    let before = available(&d, &root).await?;
    c.create_snapshot(v1::CreateSnapshotRequest {
        id: "s".into(),
        source_volume_id: "v".into(),
    })
    .await?;
    let after_snapshot = available(&d, &root).await?;
    c.create_volume(create(
        "c",
        from(
            Source::FromVolume("v".into()),
            &d.root.join("c.img"),
            64 * MIB,
        ),
    ))
    .await?;
    let after_clone = available(&d, &root).await?;
    let mib = |b: u64| b as f64 / MIB as f64;
    println!(
        "available: {:.1} MiB, after the snapshot {:.1} MiB, after the clone {:.1} MiB",
        mib(before),
        mib(after_snapshot),
        mib(after_clone)
    );
    // The snapshot made v's 32 written MiB shared: v may allocate them again.
    ensure!(
        before.saturating_sub(after_snapshot) >= 30 * MIB,
        "a snapshot of 32 written MiB left the capacity at {:.1} of {:.1} MiB",
        mib(after_snapshot),
        mib(before)
    );
    // The clone may write all of its 64 MiB anew (its blocks are all shared).
    ensure!(
        after_snapshot.saturating_sub(after_clone) >= 60 * MIB,
        "a clone of 64 MiB left the capacity at {:.1} of {:.1} MiB",
        mib(after_clone),
        mib(after_snapshot)
    );
    tear_down(&mut d, &mut c, &["c", "v"], &["s"], &fs).await
}
