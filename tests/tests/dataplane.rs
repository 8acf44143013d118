//! The dataplane against the real ublk driver: every backend on every I/O path, file systems,
//! flush/FUA and discard reaching the backing file, scale, teardown under load, bad input.
#![cfg(feature = "vm")]

use anyhow::{ensure, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;
use ublkd_dataplane::hooks::{self, Fault};
use ublkd_dataplane::{
    BackendSpec, DataplaneError, DevId, DeviceSpec, ErrorKind, IoPath, OpKind, SpecError, Toggle,
};
use ublkd_tests::guest::{self, PATHS};
use ublkd_tests::MIB;

/// fio write+verify with random 4k-128k I/O over the whole device, then the last sector by hand,
/// then I/O past the end; on each path, in each zero-copy mode of `zero_copy`.
fn verify_backend(
    backend: impl Fn(&Path) -> Result<BackendSpec>,
    verifies: bool,
    zero_copy: &[Toggle],
) -> Result<()> {
    let dir = guest::scratch("verify")?;
    let dp = guest::dataplane()?;
    let modes = PATHS
        .into_iter()
        .flat_map(|p| zero_copy.iter().map(move |&z| (p, z)));
    for (path, zc) in modes {
        let size = 64 * MIB;
        let info = dp.add_device(DeviceSpec {
            zero_copy: zc,
            ..guest::spec(backend(&dir)?, size, path)
        })?;
        assert_eq!(info.io_path, path);
        assert_eq!(info.zero_copy, zc == Toggle::On, "zero copy as asked");
        let dev = &info.block_device;
        println!(
            "{} on {:?}, zero copy {}: {}",
            info.spec.backend.kind(),
            path,
            info.zero_copy,
            dev.display()
        );
        let mut args = vec![
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=16",
            "--size=100%",
            "--io_size=48m",
        ];
        if verifies {
            args.extend(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1"]);
        }
        let report = guest::fio(dev, &args)?;
        assert!(ublkd_tests::fio_total_bytes(&report) >= 48 * MIB);

        // The last block, written and read back through the page cache and a flush.
        let f = OpenOptions::new().read(true).write(true).open(dev)?;
        let last = size - 4096;
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        f.write_all_at(&pattern, last)?;
        f.sync_all()?;
        let direct = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(dev)?;
        let mut back = AlignedBlock::new();
        back.as_mut().fill(0xa5);
        direct.read_exact_at(back.as_mut(), last)?;
        if verifies {
            assert_eq!(back.as_mut(), &pattern[..], "last block reads back");
        } else if info.zero_copy {
            // The request's pages are the reader's own buffer, which null never touches.
            assert!(
                back.as_mut().iter().all(|&b| b == 0xa5),
                "null with zero copy touches no data"
            );
        } else {
            // By copy the read returns the tag's copy buffer as the kernel filled it last:
            // data this volume wrote, never the reader's own bytes.
            assert!(
                !back.as_mut().iter().all(|&b| b == 0xa5),
                "a null read by copy fills the reader's buffer from the server's"
            );
        }
        // Past the end: reads see end of device, writes are refused.
        let mut one = [0u8; 512];
        assert_eq!(f.read_at(&mut one, size)?, 0, "read at capacity");
        let err = f.write_at(&one, size).and_then(|_| f.sync_all());
        assert!(err.is_err(), "write past capacity must fail");
        drop((f, direct));

        let stats = dp.stats(info.dev_id)?;
        assert!(stats.total.ops_of(OpKind::Write) > 0);
        assert!(stats.total.bytes_of(OpKind::Write) >= 48 * MIB);
        assert_eq!(stats.total.errors, 0, "no backend errors: {stats:?}");
        assert!(stats.total.batch_sum > 0);
        assert_eq!(stats.total.zero_copy_fallbacks, 0);
        if info.zero_copy {
            assert_eq!(
                stats.total.copy_buffer_bytes, 0,
                "zero copy allocates no copy buffers"
            );
        } else {
            assert!(stats.total.copy_buffer_bytes > 0);
        }
        dp.delete_device(info.dev_id)?;
        guest::wait_gone(dev, Duration::from_secs(5))?;
    }
    dp.shutdown()?;
    Ok(())
}

/// Every registration fails (the kernel gets a buffer slot it cannot use): each request is
/// delivered with UBLK_IO_F_NEED_REG_BUF and must still be served, by copy.
#[test]
fn zero_copy_fallback_serves_requests_by_copy() -> Result<()> {
    let dir = guest::scratch("fallback")?;
    let dp = guest::dataplane()?;
    for (i, path) in PATHS.into_iter().enumerate() {
        let size = 32 * MIB;
        let backing = guest::backing_file(&dir, &format!("fb{i}.img"), size)?;
        hooks::arm(Fault::EveryRequestByCopy, 1);
        let info = dp.add_device(DeviceSpec {
            zero_copy: Toggle::On,
            ..guest::spec(BackendSpec::File { path: backing }, size, path)
        })?;
        assert!(info.zero_copy && info.every_request_by_copy, "{info:?}");
        assert!(!info.zero_copy_in_use(), "{info:?}");
        guest::fio(
            &info.block_device,
            &[
                "--rw=randwrite",
                "--bsrange=4k-128k",
                "--iodepth=16",
                "--size=100%",
                "--io_size=24m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
            ],
        )?;
        let stats = dp.stats(info.dev_id)?;
        println!(
            "fallback on {path:?}: {} requests",
            stats.total.zero_copy_fallbacks
        );
        assert_eq!(stats.total.errors, 0, "{stats:?}");
        assert!(
            stats.total.zero_copy_fallbacks >= stats.total.ops_of(OpKind::Write),
            "every data request took the fallback: {stats:?}"
        );
        assert!(
            stats.total.copy_buffer_bytes > 0,
            "copy buffers made on demand"
        );
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    Ok(())
}

struct AlignedBlock(Box<[u8]>, usize);
impl AlignedBlock {
    fn new() -> Self {
        let b = vec![0u8; 8192].into_boxed_slice();
        let off = (4096 - (b.as_ptr() as usize % 4096)) % 4096;
        Self(b, off)
    }
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0[self.1..self.1 + 4096]
    }
}

#[test]
fn null_backend_serves_both_paths() -> Result<()> {
    verify_backend(|_| Ok(BackendSpec::Null), false, &[Toggle::On, Toggle::Off])
}

#[test]
fn ram_backend_verifies_on_both_paths() -> Result<()> {
    verify_backend(
        |_| Ok(BackendSpec::Ram { path: None }),
        true,
        &[Toggle::Off],
    )
}

#[test]
fn file_backend_verifies_on_both_paths() -> Result<()> {
    verify_backend(
        |dir| {
            Ok(BackendSpec::File {
                path: guest::backing_file(dir, "verify.img", 64 * MIB)?,
            })
        },
        true,
        &[Toggle::On, Toggle::Off],
    )
}

/// mkfs.ext4, mount, write files, sync, umount, fsck -fn clean.
fn ext4_round_trip(backend: BackendSpec, path: IoPath) -> Result<()> {
    let dp = guest::dataplane()?;
    let info = dp.add_device(guest::spec(backend, 256 * MIB, path))?;
    let dev = info.block_device.display().to_string();
    let mnt = guest::scratch("mnt")?;
    let m = mnt.display();
    guest::sh(&format!("mkfs.ext4 -q -F {dev}"))?;
    guest::sh(&format!("mount {dev} {m}"))?;
    let written = guest::sh(&format!(
        "for i in $(seq 1 20); do head -c 1048576 /dev/urandom > {m}/f$i; done; \
         sync; cat {m}/f* | md5sum"
    ));
    let umount = guest::sh(&format!("umount {m}"));
    let written = written?;
    umount?;
    guest::sh(&format!("fsck.ext4 -fn {dev}"))?;
    guest::sh(&format!("mount -o ro {dev} {m}"))?;
    let again = guest::sh(&format!("cat {m}/f* | md5sum"));
    guest::sh(&format!("umount {m}"))?;
    assert_eq!(written, again?, "files read back after remount");
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    Ok(())
}

#[test]
fn ext4_on_ram_volume_is_clean_on_both_paths() -> Result<()> {
    for path in PATHS {
        ext4_round_trip(BackendSpec::Ram { path: None }, path)?;
    }
    Ok(())
}

#[test]
fn ext4_on_file_volume_is_clean_on_both_paths() -> Result<()> {
    let dir = guest::scratch("ext4")?;
    for (i, path) in PATHS.into_iter().enumerate() {
        let file = guest::backing_file(&dir, &format!("fs{i}.img"), 256 * MIB)?;
        ext4_round_trip(BackendSpec::File { path: file }, path)?;
    }
    Ok(())
}

#[test]
fn flush_and_fua_writes_reach_the_backing_file() -> Result<()> {
    let dir = guest::scratch("flush")?;
    let dp = guest::dataplane()?;
    for (i, path) in PATHS.into_iter().enumerate() {
        let size = 16 * MIB;
        let file = guest::backing_file(&dir, &format!("flush{i}.img"), size)?;
        let info = dp.add_device(guest::spec(
            BackendSpec::File { path: file.clone() },
            size,
            path,
        ))?;
        let dev = info.block_device.display().to_string();
        // Buffered writes + fsync (FLUSH), then O_DSYNC direct writes (FUA).
        guest::sh(&format!(
            "head -c 4194304 /dev/urandom > {d}/pattern && \
             dd if={d}/pattern of={dev} bs=1M count=3 conv=fsync status=none && \
             dd if={d}/pattern of={dev} bs=1M skip=3 seek=3 count=1 oflag=direct,dsync status=none",
            d = dir.display()
        ))?;
        let stats = dp.stats(info.dev_id)?;
        assert!(stats.total.ops_of(OpKind::Flush) > 0, "fsync sent a flush");
        let mut want = vec![0u8; 4 << 20];
        File::open(dir.join("pattern"))?.read_exact(&mut want)?;
        let mut got = vec![0u8; 4 << 20];
        let mut backing = File::open(&file)?;
        backing.seek(SeekFrom::Start(0))?;
        backing.read_exact(&mut got)?;
        assert!(
            got == want,
            "backing file holds exactly what was written ({path:?})"
        );
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    Ok(())
}

#[test]
fn discard_punches_holes_and_reads_zeros() -> Result<()> {
    let dir = guest::scratch("discard")?;
    let dp = guest::dataplane()?;
    for (i, path) in PATHS.into_iter().enumerate() {
        let size = 16 * MIB;
        let file = guest::backing_file(&dir, &format!("d{i}.img"), size)?;
        let info = dp.add_device(guest::spec(
            BackendSpec::File { path: file.clone() },
            size,
            path,
        ))?;
        let dev = info.block_device.display().to_string();
        guest::sh(&format!(
            "dd if=/dev/urandom of={dev} bs=1M count=8 oflag=direct status=none"
        ))?;
        let before = std::fs::metadata(&file)?.blocks();
        guest::sh(&format!("blkdiscard -o 1048576 -l 4194304 {dev}"))?;
        let after = std::fs::metadata(&file)?.blocks();
        assert!(
            after + (4 << 20) / 512 <= before,
            "4 MiB of blocks freed: {before} -> {after} sectors"
        );
        assert_eq!(std::fs::metadata(&file)?.len(), size, "size kept");
        let zeros = guest::sh(&format!(
            "dd if={dev} bs=1M skip=1 count=4 iflag=direct status=none | tr -d '\\000' | wc -c"
        ))?;
        assert_eq!(zeros.trim(), "0", "discarded range reads zeros");
        let kept = guest::sh(&format!(
            "dd if={dev} bs=1M skip=6 count=1 iflag=direct status=none | tr -d '\\000' | wc -c"
        ))?;
        ensure!(kept.trim() != "0", "data outside the range stays");
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    Ok(())
}

#[test]
fn thirty_two_devices_on_two_workers_with_fio_on_all() -> Result<()> {
    let dir = guest::scratch("scale")?;
    let dp = guest::dataplane()?;
    let threads_before = guest::thread_count()?;
    let mut devs = Vec::new();
    for i in 0..32u32 {
        let backend = match i % 3 {
            0 => BackendSpec::Null,
            1 => BackendSpec::Ram { path: None },
            _ => BackendSpec::File {
                path: guest::backing_file(&dir, &format!("s{i}.img"), 32 * MIB)?,
            },
        };
        let spec = DeviceSpec {
            queue_depth: 16,
            max_io_bytes: 128 << 10,
            ..guest::spec(backend, 32 * MIB, PATHS[i as usize % 2])
        };
        devs.push(dp.add_device(spec)?);
    }
    let threads = guest::thread_count()?;
    assert!(
        threads <= threads_before + guest::thread_allowance(2, 64),
        "adding 32 devices added threads: {threads_before} -> {threads}: {:?}",
        guest::thread_names()
    );
    assert_eq!(dp.worker_count(), 2);
    // The io-wq limits follow the queues: 64 over two workers, so both grew from the idle floor.
    let iowq = |dp: &ublkd_dataplane::Handle| -> Result<Vec<[u32; 2]>> {
        Ok(dp.worker_stats()?.iter().map(|w| w.iowq_limits).collect())
    };
    let idle = ublkd_dataplane::iowq_limits(0);
    let grown = iowq(&dp)?;
    assert!(
        grown.iter().all(|l| l[0] > idle[0]),
        "limits {grown:?} grew past {idle:?}"
    );
    let mut cmd = String::from(
        "fio --ioengine=io_uring --direct=1 --rw=randrw --bs=4k --iodepth=4 \
         --runtime=3 --time_based --output-format=terse",
    );
    for d in &devs {
        cmd.push_str(&format!(
            " --name=j{0} --filename={1}",
            d.dev_id,
            d.block_device.display()
        ));
    }
    let out = guest::sh(&cmd)?;
    assert_eq!(out.lines().count(), 32, "one result per device");
    let threads = guest::thread_count()?;
    assert!(
        threads <= threads_before + guest::thread_allowance(2, 64),
        "under load: {threads_before} -> {threads}: {:?}",
        guest::thread_names()
    );
    for d in &devs {
        let s = dp.stats(d.dev_id)?;
        assert!(
            s.total.ops_of(OpKind::Read) > 0,
            "device {} served reads",
            d.dev_id
        );
        assert_eq!(s.total.errors, 0);
    }
    for d in &devs {
        dp.delete_device(d.dev_id)?;
    }
    assert!(guest::ublk_char_devices()?.is_empty());
    let after = iowq(&dp)?;
    assert!(
        after.iter().all(|&l| l == idle),
        "back to {idle:?}: {after:?}"
    );
    dp.shutdown()?;
    Ok(())
}

#[test]
fn one_hundred_twenty_eight_volumes_on_two_workers() -> Result<()> {
    let dp = guest::dataplane()?;
    let threads_before = guest::thread_count()?;
    let mut ids = Vec::new();
    for i in 0..128u32 {
        let spec = DeviceSpec {
            queues: 1,
            queue_depth: 8,
            max_io_bytes: 64 << 10,
            ..guest::spec(BackendSpec::Null, 16 * MIB, PATHS[i as usize % 2])
        };
        ids.push(dp.add_device(spec)?.dev_id);
    }
    // io_uring may start a few io-wq helpers (capped); nothing grows with the device count.
    let threads = guest::thread_count()?;
    assert!(
        threads <= threads_before + guest::thread_allowance(2, 128),
        "128 volumes added threads: {threads_before} -> {threads}: {:?}",
        guest::thread_names()
    );
    assert_eq!(dp.list()?.len(), 128);
    // Each one serves I/O.
    for id in ids.iter().step_by(17) {
        guest::sh(&format!(
            "dd if=/dev/ublkb{id} of=/dev/null bs=4k count=16 iflag=direct status=none"
        ))?;
    }
    for id in ids {
        dp.delete_device(id)?;
    }
    dp.shutdown()?;
    Ok(())
}

#[test]
fn delete_while_fio_runs_ends_cleanly() -> Result<()> {
    for path in PATHS {
        let dp = guest::dataplane()?;
        let info = dp.add_device(guest::spec(BackendSpec::Ram { path: None }, 64 * MIB, path))?;
        let mut fio = std::process::Command::new("fio")
            .args([
                "--name=bg",
                "--ioengine=io_uring",
                "--direct=1",
                "--rw=randrw",
                "--bs=4k",
                "--iodepth=16",
                "--runtime=60",
                "--time_based",
                "--output=/dev/null",
            ])
            .arg(format!("--filename={}", info.block_device.display()))
            .spawn()?;
        std::thread::sleep(Duration::from_millis(1500));
        dp.delete_device(info.dev_id)
            .context("delete while fio runs")?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if fio.try_wait()?.is_some() {
                break;
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "fio did not end after delete"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        guest::wait_gone(&info.block_device, Duration::from_secs(5))?;
        assert!(!info.char_device.exists());
        let stuck = guest::d_state_tasks();
        assert!(stuck.is_empty(), "tasks stuck in D state: {stuck:?}");
        dp.shutdown()?;
    }
    Ok(())
}

#[test]
fn bad_specs_get_typed_errors_and_leak_nothing() -> Result<()> {
    let dir = guest::scratch("bad")?;
    let dp = guest::dataplane()?;
    let fds = guest::fd_count()?;
    let good = guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Auto);
    let cases: Vec<(&str, DeviceSpec, ErrorKind)> = vec![
        (
            "size 0",
            DeviceSpec {
                size_bytes: 0,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "size not a multiple of the block size",
            DeviceSpec {
                size_bytes: 64 * MIB + 512,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "depth 0",
            DeviceSpec {
                queue_depth: 0,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "depth 4097",
            DeviceSpec {
                queue_depth: 4097,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "queues 0",
            DeviceSpec {
                queues: 0,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "queues 4096",
            DeviceSpec {
                queues: 4096,
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "missing backing file",
            DeviceSpec {
                backend: BackendSpec::File {
                    path: dir.join("nope.img"),
                },
                ..good.clone()
            },
            ErrorKind::NotFound,
        ),
        (
            "backing path is a directory",
            DeviceSpec {
                backend: BackendSpec::File { path: dir.clone() },
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
        (
            "backing file too small",
            DeviceSpec {
                backend: BackendSpec::File {
                    path: guest::backing_file(&dir, "small.img", MIB)?,
                },
                ..good.clone()
            },
            ErrorKind::InvalidArgument,
        ),
    ];
    for (what, spec, kind) in cases {
        let err = dp.add_device(spec).expect_err(what);
        println!("{what}: {err:#}");
        assert_eq!(err.kind(), kind, "{what}: {err:?}");
    }
    let err = dp.delete_device(DevId(12345)).expect_err("unknown device");
    assert!(matches!(err, DataplaneError::NoSuchDevice(DevId(12345))));
    let queues_err = dp
        .add_device(DeviceSpec {
            queues: 0,
            ..good.clone()
        })
        .expect_err("queues 0");
    assert!(matches!(
        queues_err,
        DataplaneError::Spec(SpecError::Queues { .. })
    ));
    assert!(dp.list()?.is_empty(), "no device left behind");
    assert!(
        guest::ublk_char_devices()?.is_empty(),
        "no kernel device left behind"
    );
    assert_eq!(guest::fd_count()?, fds, "no descriptor leaked");
    // And the dataplane still works.
    let info = dp.add_device(good)?;
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    Ok(())
}

#[test]
fn backend_errors_reach_the_client_and_the_queue_keeps_serving() -> Result<()> {
    // A backing file on a 2 MiB tmpfs: writes past what fits fail in the backend with ENOSPC.
    let dir = guest::scratch("enospc")?;
    guest::sh(&format!("mount -t tmpfs -o size=2m tiny {}", dir.display()))?;
    let result = (|| -> Result<()> {
        let file = guest::backing_file(&dir, "full.img", 64 * MIB)?;
        let dp = guest::dataplane()?;
        for path in PATHS {
            let info = dp.add_device(guest::spec(
                BackendSpec::File { path: file.clone() },
                64 * MIB,
                path,
            ))?;
            let dev = info.block_device.display().to_string();
            let write = guest::sh(&format!(
                "dd if=/dev/urandom of={dev} bs=1M count=8 oflag=direct status=none"
            ));
            assert!(
                write.is_err(),
                "writes beyond the backing store must fail ({path:?})"
            );
            let stats = dp.stats(info.dev_id)?;
            assert!(
                stats.total.errors > 0,
                "the backend error was counted: {stats:?}"
            );
            // The queue still serves: reads work, and a small write that fits succeeds.
            guest::sh(&format!(
                "dd if={dev} of=/dev/null bs=1M count=4 iflag=direct status=none"
            ))?;
            guest::sh(&format!(
                "rm -f {0}/full.img; truncate -s 64M {0}/full.img",
                dir.display()
            ))
            .ok();
            dp.delete_device(info.dev_id)?;
            assert!(guest::d_state_tasks().is_empty());
        }
        dp.shutdown()?;
        Ok(())
    })();
    guest::sh(&format!("umount {}", dir.display()))?;
    result
}

/// A kernel CPU list (`0-1,3`).
fn cpu_list(s: &str) -> Vec<usize> {
    s.trim()
        .split(',')
        .filter_map(|p| match p.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?..=b.parse().ok()?).collect::<Vec<usize>>()),
            None => p.parse().ok().map(|c| vec![c]),
        })
        .flatten()
        .collect()
}

/// A worker that looks for work in user space before it sleeps (`Config::idle_spin`) serves a
/// file volume on each path with every byte verified, and says so in its counters: it spins
/// for as long as it was given, and waits ended while it spun. A worker not given a spin does
/// not spin and counts no waits.
#[test]
fn a_spinning_worker_verifies_a_file_volume_and_counts_its_waits() -> Result<()> {
    use ublkd_dataplane::{Config, Handle, WorkerSnapshot};
    let waits = |stats: &[WorkerSnapshot]| -> [u64; 2] {
        stats
            .iter()
            .fold([0, 0], |a, w| [a[0] + w.waits[0], a[1] + w.waits[1]])
    };
    let spin = Duration::from_millis(1);
    let dir = guest::scratch("spin")?;
    let dp = Handle::start(Config {
        cpus: vec![1],
        idle_spin: Some(spin),
        ..Config::default()
    })?;
    let workers = dp.worker_stats()?;
    ensure!(
        workers.iter().all(|w| w.idle_spin == spin),
        "every worker spins {spin:?}: {workers:?}"
    );
    for (i, path) in PATHS.into_iter().enumerate() {
        let file = guest::backing_file(&dir, &format!("spin{i}.img"), 64 * MIB)?;
        let info = dp.add_device(guest::spec(
            BackendSpec::File { path: file },
            64 * MIB,
            path,
        ))?;
        let before = waits(&dp.worker_stats()?);
        let report = guest::fio(
            &info.block_device,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=1",
                "--size=100%",
                "--io_size=4m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--cpus_allowed=0",
            ],
        )?;
        ensure!(ublkd_tests::fio_total_bytes(&report) >= 4 * MIB);
        let after = waits(&dp.worker_stats()?);
        let (spun, slept) = (after[0] - before[0], after[1] - before[1]);
        println!("{path:?}: waits that ended spinning {spun}, sleeping {slept}");
        ensure!(spun > 0, "{path:?}: no wait ended while the worker spun");
        let stats = dp.stats(info.dev_id)?;
        ensure!(
            stats.total.errors == 0,
            "{path:?}: backend errors: {stats:?}"
        );
        dp.delete_device(info.dev_id)?;
        guest::wait_gone(&info.block_device, Duration::from_secs(5))?;
    }
    dp.shutdown()?;
    let dp = Handle::start(Config {
        cpus: vec![1],
        ..Config::default()
    })?;
    let info = dp.add_device(guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Auto))?;
    guest::fio(
        &info.block_device,
        &["--rw=randread", "--bs=4k", "--number_ios=1024"],
    )?;
    let workers = dp.worker_stats()?;
    ensure!(
        workers.iter().all(|w| w.idle_spin.is_zero()) && waits(&workers) == [0, 0],
        "a worker given no spin sleeps at once and counts nothing: {workers:?}"
    );
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    Ok(())
}

/// The placement a device reports is the one in force, for each policy: fio pinned to CPU c
/// submits to the queue blk-mq maps c to (sysfs `mq/*/cpu_list`), and the worker on the CPU
/// the device reports for that queue starts those requests, the other worker none. Same CPU:
/// each queue's worker is on a CPU that submits to it; other CPU: on one that does not; auto
/// (the workers share their CPUs with fio here) is other CPU; spread: by number.
#[test]
fn each_placement_serves_a_queue_on_the_cpu_the_volume_reports() -> Result<()> {
    use ublkd_dataplane::{Config, Handle, PlacementPolicy, PlacementReason, QueuePlacement};
    for (policy, want, reason) in [
        (
            PlacementPolicy::SameCpu,
            QueuePlacement::SameCpu,
            PlacementReason::Asked,
        ),
        (
            PlacementPolicy::OtherCpu,
            QueuePlacement::OtherCpu,
            PlacementReason::Asked,
        ),
        (
            PlacementPolicy::Auto,
            QueuePlacement::OtherCpu,
            PlacementReason::SharedCpus,
        ),
        (
            PlacementPolicy::Spread,
            QueuePlacement::Spread,
            PlacementReason::Asked,
        ),
    ] {
        let dp = Handle::start(Config {
            cpus: vec![0, 1],
            placement: policy,
            ..Config::default()
        })?;
        let info = dp.add_device(DeviceSpec {
            queues: 2,
            ..guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Auto)
        })?;
        ensure!(
            (info.placement, info.placement_reason) == (want, reason),
            "{policy:?}: the device reports {:?} ({:?})",
            info.placement,
            info.placement_reason
        );
        ensure!(
            info.queue_cpus.len() == 2,
            "{policy:?}: a CPU per queue: {:?}",
            info.queue_cpus
        );
        let name = info
            .block_device
            .file_name()
            .context("device name")?
            .to_string_lossy()
            .into_owned();
        for cpu in [0usize, 1] {
            // The queue CPU `cpu` submits to.
            let q = (0..2usize)
                .find(|q| {
                    guest::sh(&format!("cat /sys/block/{name}/mq/{q}/cpu_list"))
                        .map(|l| cpu_list(&l).contains(&cpu))
                        .unwrap_or(false)
                })
                .context("no queue lists the CPU")?;
            let server = info.queue_cpus[q];
            match want {
                QueuePlacement::SameCpu => ensure!(
                    server == cpu,
                    "{policy:?}: queue {q} of CPU {cpu} served on {server}"
                ),
                QueuePlacement::OtherCpu => ensure!(
                    server != cpu,
                    "{policy:?}: queue {q} of CPU {cpu} served on {server}"
                ),
                QueuePlacement::Spread => {}
            }
            let served = |stats: &[ublkd_dataplane::WorkerSnapshot]| -> Result<(u64, u64)> {
                let on = stats
                    .iter()
                    .find(|w| w.cpu == server)
                    .context("no worker")?;
                let off = stats
                    .iter()
                    .find(|w| w.cpu != server)
                    .context("one worker")?;
                Ok((on.batch_sum, off.batch_sum))
            };
            const IOS: u64 = 4096;
            let before = served(&dp.worker_stats()?)?;
            let pin = format!("--cpus_allowed={cpu}");
            let ios = format!("--number_ios={IOS}");
            guest::fio(
                &info.block_device,
                &["--rw=randread", "--bs=4k", "--iodepth=8", &pin, &ios],
            )?;
            let after = served(&dp.worker_stats()?)?;
            let (on, off) = (after.0 - before.0, after.1 - before.1);
            println!(
                "{policy:?}: fio on CPU {cpu} -> queue {q}, reported on CPU {server}: that worker started {on} requests, the other {off}"
            );
            ensure!(
                on >= IOS && off <= IOS / 100,
                "{policy:?}: fio on CPU {cpu}: the worker on CPU {server} started {on} of {IOS} requests, the other {off}"
            );
        }
        dp.delete_device(info.dev_id)?;
        dp.shutdown()?;
    }
    Ok(())
}

/// A one-queue volume gets no I/O scheduler. The kernel's default for one queue, mq-deadline,
/// dispatches each request from a kblockd worker, a wake-up more per I/O (docs/performance.md,
/// "The I/O scheduler of a one-queue volume"). When setting it fails, the volume still serves,
/// with the kernel's default, and the failure is counted (`io_scheduler`).
#[test]
fn a_one_queue_volume_has_no_io_scheduler_and_a_failure_to_set_it_is_counted() -> Result<()> {
    use ublkd_dataplane::stats::CleanupStep;
    let dp = guest::dataplane()?;
    let scheduler = |dev: &Path| -> Result<String> {
        let name = dev.file_name().context("a device name")?.to_string_lossy();
        ublkd_tests::read_trimmed(format!("/sys/block/{name}/queue/scheduler"))
    };
    let failures = || -> Result<u64> {
        let counts = dp.control_cleanup_errors()?;
        let step = counts.iter().find(|(s, _)| *s == CleanupStep::IoScheduler);
        Ok(step.map_or(0, |(_, n)| *n))
    };
    let spec = DeviceSpec {
        queues: 1,
        ..guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Auto)
    };
    for fail in [false, true] {
        if fail {
            hooks::arm(Fault::IoScheduler, 1);
        }
        let before = failures()?;
        let info = dp.add_device(spec.clone())?;
        let got = scheduler(&info.block_device)?;
        let want = if fail { "[mq-deadline]" } else { "[none]" };
        ensure!(got.contains(want), "scheduler {got:?}, want {want}");
        ensure!(
            failures()? - before == u64::from(fail),
            "counted once when it failed"
        );
        guest::fio(
            &info.block_device,
            &["--rw=randread", "--bs=4k", "--number_ios=256"],
        )?;
        dp.delete_device(info.dev_id)?;
        guest::wait_gone(&info.block_device, Duration::from_secs(5))?;
    }
    dp.shutdown()?;
    Ok(())
}
