//! The NVMe backend against the guest's emulated NVMe controller (`/dev/ng0n1`, with poll
//! queues): a whole namespace and windows of it on every I/O path, with and without zero copy,
//! polled and interrupt-driven, on one shared IOPOLL ring (Linux >= 7.1) and on the older
//! kernels' split rings; commands reaching the namespace, checked by reading it directly;
//! device errors reaching the client.
#![cfg(feature = "vm")]

use anyhow::{ensure, Context, Result};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use ublkd_dataplane::hooks::{self, Fault};
use ublkd_dataplane::{
    BackendSpec, Config, DataplaneError, DeviceSpec, ErrorKind, Growth, Handle, IoPath, OpKind,
    Toggle, Window, DEDICATED_SPIN,
};
use ublkd_tests::guest::{self, PATHS};
use ublkd_tests::MIB;

const NG: &str = "/dev/ng0n1";
const BLK: &str = "/dev/nvme0n1";

fn dataplane() -> Result<Handle> {
    dataplane_with(false)
}

/// With `dedicated_cpus`: the operator says the workers' CPUs run nothing else, so
/// `poll = auto` polls.
fn dataplane_with(dedicated_cpus: bool) -> Result<Handle> {
    Ok(Handle::start(Config {
        cpus: vec![0, 1],
        dedicated_cpus,
        ..Config::default()
    })?)
}

fn window(offset: u64, len: u64) -> BackendSpec {
    BackendSpec::Nvme {
        path: PathBuf::from(NG),
        window: Some(Window { offset, len }),
        keep_data: false,
    }
}

fn namespace_bytes() -> Result<u64> {
    Ok(ublkd_tests::read_trimmed("/sys/block/nvme0n1/size")?.parse::<u64>()? * 512)
}

/// `len` bytes of `path` at `offset`, read with O_DIRECT (past any page cache).
fn read_direct(path: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
    let out = guest::scratch("direct")?.join("read");
    guest::sh(&format!(
        "dd if={path} of={o} bs=1M skip={s} count={c} iflag=direct,skip_bytes,count_bytes status=none",
        o = out.display(),
        s = offset,
        c = len
    ))?;
    Ok(std::fs::read(out)?)
}

/// Writes `byte` over `len` bytes of `path` at `offset` with O_DIRECT.
fn fill_direct(path: &str, offset: u64, len: u64, byte: u8) -> Result<()> {
    guest::sh(&format!(
        "head -c {len} /dev/zero | tr '\\000' '\\{byte:03o}' | \
         dd of={path} bs=1M seek={offset} oflag=direct,seek_bytes iflag=fullblock status=none"
    ))?;
    Ok(())
}

fn all(buf: &[u8], byte: u8) -> bool {
    buf.iter().all(|&b| b == byte)
}

fn fio_verify(dev: &Path, io_size: &str) -> Result<()> {
    let io = format!("--io_size={io_size}");
    guest::fio(
        dev,
        &[
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=16",
            "--size=100%",
            io.as_str(),
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    )?;
    Ok(())
}

/// fio write+verify on a whole-namespace volume in every mode: both I/O paths, zero copy on and
/// off, polled and interrupt-driven; then polled on the split rings of older kernels.
#[test]
fn whole_namespace_verifies_in_every_mode() -> Result<()> {
    let ns = namespace_bytes()?;
    let whole = BackendSpec::Nvme {
        path: PathBuf::from(NG),
        window: None,
        keep_data: false,
    };
    let run = |dp: &Handle, path: IoPath, zc: Toggle, poll: Toggle| -> Result<(bool, bool)> {
        let info = dp.add_device(DeviceSpec {
            zero_copy: zc,
            poll,
            ..guest::spec(whole.clone(), ns, path)
        })?;
        println!(
            "nvme {path:?} zero_copy={} polled={}: {}",
            info.zero_copy,
            info.polled,
            info.block_device.display()
        );
        // The volume's limits come from the namespace: passthrough is never split.
        let q = |dev: &str, attr: &str| -> Result<u64> {
            Ok(ublkd_tests::read_trimmed(format!("/sys/block/{dev}/queue/{attr}"))?.parse()?)
        };
        let name = format!("ublkb{}", info.dev_id);
        ensure!(q(&name, "max_hw_sectors_kb")? <= q("nvme0n1", "max_hw_sectors_kb")?);
        ensure!(q(&name, "logical_block_size")? >= q("nvme0n1", "logical_block_size")?);
        ensure!(
            q(&name, "write_zeroes_max_bytes")? > 0,
            "write zeroes offered"
        );
        ensure!(q(&name, "discard_max_bytes")? > 0, "discard offered");
        fio_verify(&info.block_device, "16m")?;
        let stats = dp.stats(info.dev_id)?;
        ensure!(stats.total.errors == 0, "no errors: {stats:?}");
        ensure!(stats.total.ops_of(OpKind::Write) > 0);
        ensure!(stats.total.zero_copy_fallbacks == 0);
        if info.zero_copy {
            ensure!(
                stats.total.copy_buffer_bytes == 0,
                "zero copy copies nothing"
            );
        }
        dp.delete_device(info.dev_id)?;
        Ok((info.zero_copy, info.polled))
    };
    let dp = dataplane()?;
    ensure!(
        dp.iopoll_shared(),
        "Linux 7.3 lets ublk commands share an IOPOLL ring"
    );
    for path in PATHS {
        for (zc, poll) in [
            (Toggle::On, Toggle::On),
            (Toggle::Off, Toggle::On),
            (Toggle::On, Toggle::Off),
            (Toggle::Off, Toggle::Off),
        ] {
            let got = run(&dp, path, zc, poll)?;
            assert_eq!(got, (zc == Toggle::On, poll == Toggle::On));
        }
    }
    // Defaults on this kernel: zero copy on; polling off, since the guest's two CPUs also run
    // fio (auto polls only on dedicated CPUs, where it pays), and on where the operator says
    // the CPUs are dedicated.
    assert_eq!(
        run(&dp, IoPath::Auto, Toggle::Auto, Toggle::Auto)?,
        (true, false)
    );
    dp.shutdown()?;
    let dp = dataplane_with(true)?;
    assert_eq!(
        run(&dp, IoPath::Auto, Toggle::Auto, Toggle::Auto)?,
        (true, true)
    );
    dp.shutdown()?;

    // Older kernels: polling needs a second ring and copies; asking for both fails.
    hooks::arm(Fault::IopollSplit, 1);
    let dp = dataplane_with(true)?;
    ensure!(!dp.iopoll_shared(), "the hook made the probe say no");
    for path in PATHS {
        assert_eq!(run(&dp, path, Toggle::Auto, Toggle::On)?, (false, true));
    }
    assert_eq!(
        run(&dp, IoPath::Auto, Toggle::Auto, Toggle::Auto)?,
        (true, false)
    );
    let both = dp.add_device(DeviceSpec {
        zero_copy: Toggle::On,
        poll: Toggle::On,
        ..guest::spec(whole.clone(), ns, IoPath::Auto)
    });
    assert!(
        matches!(&both, Err(e) if e.kind() == ErrorKind::FailedPrecondition),
        "{both:?}"
    );
    dp.shutdown()?;
    Ok(())
}

/// Two adjacent windows of one namespace: each volume's data lands inside its window and
/// nowhere else (read back from the namespace itself); overlapping and bad windows are refused.
#[test]
fn windows_keep_their_data_apart() -> Result<()> {
    let ns = namespace_bytes()?;
    let (a, b, len) = (16 * MIB, 48 * MIB, 32 * MIB);
    // Guards just outside both windows.
    fill_direct(BLK, a - 4 * MIB, 4 * MIB, 0xcc)?;
    fill_direct(BLK, b + len, 4 * MIB, 0xcc)?;
    let dp = dataplane()?;
    let va = dp.add_device(guest::spec(window(a, len), len, IoPath::Batch))?;
    let vb = dp.add_device(guest::spec(window(b, len), len, IoPath::PerIo))?;
    for v in [&va, &vb] {
        fio_verify(&v.block_device, "16m")?;
    }
    let dev = |v: &ublkd_dataplane::DeviceInfo| v.block_device.display().to_string();
    fill_direct(&dev(&va), 0, len, 0xa1)?;
    fill_direct(&dev(&vb), 0, len, 0xb2)?;
    ensure!(
        all(&read_direct(BLK, a - 4 * MIB, 4 * MIB)?, 0xcc),
        "guard before A intact"
    );
    ensure!(
        all(&read_direct(BLK, a, len)?, 0xa1),
        "window A holds A's data"
    );
    ensure!(
        all(&read_direct(BLK, b, len)?, 0xb2),
        "window B holds B's data"
    );
    ensure!(
        all(&read_direct(BLK, b + len, 4 * MIB)?, 0xcc),
        "guard after B intact"
    );
    ensure!(all(&read_direct(&dev(&va), 0, len)?, 0xa1));
    ensure!(all(&read_direct(&dev(&vb), 0, len)?, 0xb2));

    let refused = |backend: BackendSpec, size: u64| -> Result<ErrorKind> {
        match dp.add_device(guest::spec(backend, size, IoPath::Auto)) {
            Ok(info) => {
                dp.delete_device(info.dev_id)?;
                anyhow::bail!("accepted")
            }
            Err(e) => {
                println!("refused: {}", chain(&e));
                Ok(e.kind())
            }
        }
    };
    let nvme = |path: &str| BackendSpec::Nvme {
        path: path.into(),
        window: None,
        keep_data: false,
    };
    assert_eq!(
        refused(window(40 * MIB, 16 * MIB), 16 * MIB)?,
        ErrorKind::FailedPrecondition,
        "overlaps both windows"
    );
    assert_eq!(refused(nvme(NG), 16 * MIB)?, ErrorKind::FailedPrecondition);
    assert_eq!(
        refused(window(ns - 4 * MIB, 8 * MIB), 8 * MIB)?,
        ErrorKind::InvalidArgument,
        "past the end"
    );
    assert_eq!(
        refused(window(512 * MIB + 100, 8 * MIB), 4 * MIB)?,
        ErrorKind::InvalidArgument,
        "unaligned"
    );
    assert_eq!(
        refused(window(512 * MIB, 8 * MIB), 16 * MIB)?,
        ErrorKind::InvalidArgument,
        "volume larger than its window"
    );
    assert_eq!(refused(nvme("/dev/null"), MIB)?, ErrorKind::InvalidArgument);
    assert_eq!(
        refused(nvme(BLK), MIB)?,
        ErrorKind::InvalidArgument,
        "block dev"
    );
    assert_eq!(refused(nvme("/dev/ng7n7"), MIB)?, ErrorKind::NotFound);

    // A window freed by a delete can be used again.
    dp.delete_device(va.dev_id)?;
    let again = dp.add_device(guest::spec(
        window(40 * MIB, 8 * MIB),
        8 * MIB,
        IoPath::Auto,
    ))?;
    dp.delete_device(again.dev_id)?;
    dp.delete_device(vb.dev_id)?;
    dp.shutdown()?;
    Ok(())
}

/// Flush (fsync), FUA (O_DSYNC), discard and write-zeroes on a volume reach the namespace.
#[test]
fn flush_fua_discard_and_write_zeroes_reach_the_namespace() -> Result<()> {
    let base = 128 * MIB;
    let len = 16 * MIB;
    let dir = guest::scratch("nvme-cmds")?;
    let cache = ublkd_tests::read_trimmed("/sys/block/nvme0n1/queue/write_cache")?;
    for poll in [Toggle::On, Toggle::Off] {
        let dp = dataplane()?;
        let info = dp.add_device(DeviceSpec {
            poll,
            ..guest::spec(window(base, len), len, IoPath::Auto)
        })?;
        let dev = info.block_device.display().to_string();
        guest::sh(&format!(
            "head -c 4194304 /dev/urandom > {d}/pattern && \
             dd if={d}/pattern of={dev} bs=1M count=3 conv=fsync status=none && \
             dd if={d}/pattern of={dev} bs=1M skip=3 seek=3 count=1 oflag=direct,dsync status=none",
            d = dir.display()
        ))?;
        let want = std::fs::read(dir.join("pattern"))?;
        ensure!(
            read_direct(BLK, base, 4 * MIB)? == want,
            "data written with fsync and FUA"
        );
        let stats = dp.stats(info.dev_id)?;
        if cache == "write back" {
            ensure!(stats.total.ops_of(OpKind::Flush) > 0, "fsync sent a flush");
        }
        // Write zeroes over MiB 1, discard MiB 2.
        guest::sh(&format!("blkdiscard -z -o {MIB} -l {MIB} {dev}"))?;
        ensure!(
            all(&read_direct(BLK, base + MIB, MIB)?, 0),
            "zeroed on the namespace"
        );
        guest::sh(&format!("blkdiscard -o {} -l {MIB} {dev}", 2 * MIB))?;
        ensure!(
            all(&read_direct(BLK, base + 2 * MIB, MIB)?, 0),
            "deallocated reads zeros"
        );
        ensure!(
            read_direct(BLK, base, MIB)? == want[..MIB as usize],
            "MiB 0 untouched"
        );
        ensure!(
            read_direct(BLK, base + 3 * MIB, MIB)? == want[3 * MIB as usize..],
            "MiB 3 untouched"
        );
        let stats = dp.stats(info.dev_id)?;
        println!("polled={} ops {:?}", info.polled, stats.total.ops);
        ensure!(
            stats.total.ops_of(OpKind::WriteZeroes) > 0,
            "write zeroes sent"
        );
        ensure!(stats.total.ops_of(OpKind::Discard) > 0, "discard sent");
        ensure!(stats.total.errors == 0, "{stats:?}");
        dp.delete_device(info.dev_id)?;
        dp.shutdown()?;
    }
    Ok(())
}

/// A volume whose window runs past the namespace (test hook): I/O beyond the namespace fails
/// in the device (LBA out of range), reaches the client as EIO, and the queue keeps serving.
#[test]
fn nvme_errors_reach_the_client_as_eio() -> Result<()> {
    let ns = namespace_bytes()?;
    let dp = dataplane()?;
    for (zc, poll) in [(Toggle::On, Toggle::On), (Toggle::Off, Toggle::Off)] {
        for path in PATHS {
            // The window reaches past the namespace's end, so its last blocks fail in the device.
            hooks::arm(Fault::NvmeWindowUnchecked, 1);
            let info = dp.add_device(DeviceSpec {
                zero_copy: zc,
                poll,
                ..guest::spec(
                    BackendSpec::Nvme {
                        path: PathBuf::from(NG),
                        window: Some(Window {
                            offset: ns - 4 * MIB,
                            len: 8 * MIB,
                        }),
                        keep_data: false,
                    },
                    8 * MIB,
                    path,
                )
            })?;
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags_direct()
                .open(&info.block_device)
                .context("open volume")?;
            let buf = Aligned::new(4096);
            f.write_all_at(buf.bytes(), 0)
                .context("inside the namespace")?;
            let err = f
                .write_all_at(buf.bytes(), 6 * MIB)
                .expect_err("beyond the namespace must fail");
            assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
            let mut back = Aligned::new(4096);
            f.read_exact_at(back.bytes_mut(), 0)
                .context("the queue keeps serving")?;
            let stats = dp.stats(info.dev_id)?;
            assert!(stats.total.errors > 0);
            assert_eq!(stats.total.protocol_errors, 0);
            drop(f);
            dp.delete_device(info.dev_id)?;
        }
    }
    dp.shutdown()?;
    Ok(())
}

fn chain(e: &DataplaneError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// O_DIRECT for `OpenOptions`.
trait DirectExt {
    fn custom_flags_direct(&mut self) -> &mut Self;
}

impl DirectExt for OpenOptions {
    fn custom_flags_direct(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::custom_flags(self, libc::O_DIRECT)
    }
}

/// A 4096-aligned buffer for O_DIRECT.
struct Aligned(Vec<u8>, usize, usize);

impl Aligned {
    fn new(len: usize) -> Self {
        let v = vec![0x5au8; len + 4096];
        let off = (4096 - (v.as_ptr() as usize % 4096)) % 4096;
        Self(v, off, len)
    }
    fn bytes(&self) -> &[u8] {
        &self.0[self.1..self.1 + self.2]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0[self.1..self.1 + self.2]
    }
}

/// CPU ticks (utime + stime) used so far by this process's worker threads (`ublkd-w*`).
fn worker_ticks() -> Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("ublkd-w") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat"))?;
        let after = stat.rsplit_once(") ").map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after "pid (comm) ".
        let tick = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        total += tick(11) + tick(12);
    }
    Ok(total)
}

/// A polled volume's worker spins only while NVMe commands are in flight: busy under fio,
/// asleep (no CPU) once the volume is idle.
#[test]
fn polled_workers_sleep_when_idle() -> Result<()> {
    let dp = dataplane()?;
    let info = dp.add_device(DeviceSpec {
        poll: Toggle::On,
        ..guest::spec(window(256 * MIB, 64 * MIB), 64 * MIB, IoPath::Auto)
    })?;
    ensure!(info.polled);
    let busy0 = worker_ticks()?;
    guest::fio(
        &info.block_device,
        &[
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--time_based",
            "--runtime=3",
        ],
    )?;
    let busy = worker_ticks()? - busy0;
    std::thread::sleep(std::time::Duration::from_secs(1));
    let idle0 = worker_ticks()?;
    std::thread::sleep(std::time::Duration::from_secs(3));
    let idle = worker_ticks()? - idle0;
    let hz = 100; // USER_HZ on Linux
    println!("worker CPU: {busy} ticks in 3 s of fio, {idle} ticks in 3 s idle ({hz} Hz)");
    ensure!(busy > 0, "the workers did the I/O");
    ensure!(
        idle * 4 < 3 * hz,
        "idle workers must sleep, not spin: {idle} ticks in 3 s"
    );
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    Ok(())
}

/// A fixed-length window grows with its volume into the free namespace after it, and is
/// refused (nothing changed) when that would reach another window or past the namespace's end.
#[test]
fn windows_grow_into_free_space_only() -> Result<()> {
    let ns = namespace_bytes()?;
    let dp = dataplane()?;
    let a = dp.add_device(guest::spec(window(0, 16 * MIB), 16 * MIB, IoPath::Batch))?;
    let b = dp.add_device(guest::spec(
        window(64 * MIB, 16 * MIB),
        16 * MIB,
        IoPath::Batch,
    ))?;
    let grown = dp.resize_device(a.dev_id, 32 * MIB, Growth::Erase)?;
    ensure!(grown.spec.size_bytes == 32 * MIB, "{grown:?}");
    let size = |d: &ublkd_dataplane::DeviceInfo| -> Result<u64> {
        Ok(guest::sh(&format!(
            "blockdev --getsize64 {}",
            d.block_device.display()
        ))?
        .trim()
        .parse()?)
    };
    ensure!(size(&a)? == 32 * MIB, "the kernel sees the new size");
    fio_verify(&a.block_device, "32m")?;
    let into_b = dp.resize_device(a.dev_id, 80 * MIB, Growth::Erase);
    ensure!(
        matches!(into_b, Err(DataplaneError::Overlap { .. })),
        "growing into B: {into_b:?}"
    );
    ensure!(size(&a)? == 32 * MIB, "a refused grow changes nothing");
    let past_end = dp.resize_device(b.dev_id, ns, Growth::Erase);
    ensure!(past_end.is_err(), "past the namespace's end: {past_end:?}");
    for d in [a, b] {
        dp.delete_device(d.dev_id)?;
    }
    Ok(())
}

/// An NVMe window deleted and made again never hands the new volume the old one's data (issue
/// 22, item 3): ublkd erases a new window before its device appears, and the blocks a resize
/// grows onto; a delete erases the window too, so nothing of a deleted tenant stays on the
/// namespace (issue 38, defect 7); `keep_data`, where the node allows it, adopts a window's
/// data on purpose, and is refused where it does not. Prints the create times of a 256 MiB
/// window and of the whole namespace (erase included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_made_again_reads_zeroes_not_the_last_tenants_data() -> Result<()> {
    use std::time::Instant;
    use ublkd_proto::v1;
    use ublkd_tests::api::{create, nvme, volume};
    use ublkd_tests::daemon::Daemon;
    let dir = guest::scratch("nvme-erase")?;
    let mut d = Daemon::new(&dir, 19617, "[limits]\nallow_keep_data = true")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let (off, len) = (64 * MIB, 256 * MIB);
    let delete = |id: &str| v1::DeleteVolumeRequest {
        id: id.into(),
        ..Default::default()
    };
    let started = Instant::now();
    let first = c
        .create_volume(create("w1", volume(len, nvme(NG, off, len))))
        .await?
        .into_inner();
    println!(
        "create of a 256 MiB window: {:.3} s",
        started.elapsed().as_secs_f64()
    );
    // The tenant's pattern at the start, the middle and the end of the window.
    for at in [0, len / 2, len - 4 * MIB] {
        fill_direct(&first.device_path, at, 4 * MIB, 0xab)?;
    }
    c.delete_volume(delete("w1")).await?;
    let again = c
        .create_volume(create("w2", volume(len, nvme(NG, off, len))))
        .await?
        .into_inner();
    for at in [0, len / 2, len - 4 * MIB] {
        let got = read_direct(&again.device_path, at, 4 * MIB)?;
        ensure!(
            all(&got, 0),
            "the new volume reads {} non-zero bytes of the last tenant's at {at}",
            got.iter().filter(|&&b| b != 0).count()
        );
    }
    // Growing onto blocks written outside any window: they are erased before they are served.
    fill_direct(BLK, off + len, 8 * MIB, 0xcd)?;
    c.resize_volume(v1::ResizeVolumeRequest {
        id: "w2".into(),
        size_bytes: len + 8 * MIB,
    })
    .await?;
    let grown = read_direct(&again.device_path, len, 8 * MIB)?;
    ensure!(all(&grown, 0), "the grown blocks hold old data");
    fill_direct(&again.device_path, 0, 4 * MIB, 0xef)?;
    c.delete_volume(delete("w2")).await?;
    for at in [0, len / 2, len] {
        let left = read_direct(BLK, off + at, 4 * MIB)?;
        ensure!(
            all(&left, 0),
            "the deleted volume left {} non-zero bytes on the namespace at {at}",
            left.iter().filter(|&&b| b != 0).count()
        );
    }
    // Adopting on purpose keeps the data: here, data written outside any window.
    fill_direct(BLK, off, 4 * MIB, 0xef)?;
    let mut keep = nvme(NG, off, len);
    if let v1::volume_spec::Backend::Nvme(n) = &mut keep {
        n.keep_data = true;
    }
    let adopted = c
        .create_volume(create("w3", volume(len, keep)))
        .await?
        .into_inner();
    ensure!(
        all(&read_direct(&adopted.device_path, 0, 4 * MIB)?, 0xef),
        "keep_data serves the window as it is"
    );
    c.delete_volume(delete("w3")).await?;
    // A node that does not allow it refuses keep_data, whoever asks.
    d.stop_with(libc::SIGTERM)?;
    let mut strict = Daemon::new(&guest::scratch("nvme-erase-strict")?, 19632, "")?;
    strict.start().await?;
    let mut keep = nvme(NG, off, len);
    if let v1::volume_spec::Backend::Nvme(n) = &mut keep {
        n.keep_data = true;
    }
    let refused = strict
        .volumes()
        .await?
        .create_volume(create("w4", volume(len, keep)))
        .await;
    ensure!(
        refused.as_ref().err().map(|s| s.code()) == Some(tonic::Code::PermissionDenied),
        "keep_data on a node that does not allow it: {refused:?}"
    );
    strict.stop_with(libc::SIGTERM)?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let ns = namespace_bytes()?;
    let started = Instant::now();
    c.create_volume(create("whole", volume(ns, nvme(NG, 0, 0))))
        .await?;
    println!(
        "create of the whole namespace ({} MiB): {:.3} s",
        ns / MIB,
        started.elapsed().as_secs_f64()
    );
    c.delete_volume(delete("whole")).await?;
    Ok(())
}

/// A window whose record was written and whose erase never ran (ublkd killed at
/// `create:after_record`) is erased by the next start before it is served: the new volume reads
/// zeroes where earlier data lay (issue 38, defect 1; the manager's simulator finds the same
/// ordering on its in-memory kernel). A delete erases its window now (defect 7), so the earlier
/// data is written to the namespace directly: what a release before that left, or another user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_a_windows_erase_never_serves_the_last_tenants_data() -> Result<()> {
    use ublkd_proto::v1;
    use ublkd_tests::api::{self, create};
    use ublkd_tests::daemon::Daemon;
    let ns = namespace_bytes()?;
    let (offset, len) = (ns - 32 * MIB, 8 * MIB);
    let dir = guest::scratch("erase-crash")?;
    let mut d = Daemon::new(&dir, 19631, "")?;
    let spec = |id: &str| create(id, api::volume(len, api::nvme(NG, offset, len)));
    fill_direct(BLK, offset, len, 0xab)?;
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "abort_at=create:after_record".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    ensure!(
        c.create_volume(spec("tenant-b")).await.is_err(),
        "the daemon died inside the create"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while d.exited()?.is_none() {
        ensure!(
            std::time::Instant::now() < deadline,
            "the daemon did not die"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    ensure!(
        all(&read_direct(BLK, offset, len)?, 0xab),
        "the crash came before the erase: the old data is still on the namespace"
    );
    d.env.clear();
    d.start().await?;
    let vols = d.wait_all_ready().await?;
    let b = vols
        .iter()
        .find(|v| v.id == "tenant-b")
        .context("the recorded volume came back")?;
    let seen = read_direct(&b.device_path, 0, len)?;
    ensure!(
        all(&seen, 0),
        "tenant-b reads {} non-zero bytes of the earlier data",
        seen.iter().filter(|&&x| x != 0).count()
    );
    let mut c = d.volumes().await?;
    c.delete_volume(v1::DeleteVolumeRequest {
        id: "tenant-b".into(),
        allow_missing: false,
        delete_backing: false,
        force: false,
    })
    .await?;
    d.stop_with(libc::SIGTERM)?;
    println!("the interrupted erase was finished at the restart: {len} bytes read as zeroes");
    Ok(())
}

/// A new window's erase runs off the dataplane's control thread, in chunks, with its progress in
/// the volume's state (issue 38, defect 5): while a 768 MiB window is erased slowly (a delay at
/// each 256 MiB chunk, test hook), another volume's QoS change (a control command), GetVolume
/// and a scrape of /metrics all answer before the create does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_erase_holds_up_no_other_volume() -> Result<()> {
    use ublkd_proto::v1;
    use ublkd_tests::api::{self, create};
    use ublkd_tests::daemon::Daemon;
    let dir = guest::scratch("erase-slow")?;
    let mut d = Daemon::new(&dir, 19634, "")?;
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "delay_at=erase:chunk:1500".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    c.create_volume(create("bystander", api::volume(64 * MIB, api::ram())))
        .await?;
    let len = 768 * MIB;
    let mut creator = c.clone();
    let creating = tokio::spawn(async move {
        creator
            .create_volume(create("big", api::volume(len, api::nvme(NG, 0, len))))
            .await
    });
    // The create shows its progress while it erases.
    let mut progress = None;
    while !creating.is_finished() {
        let v = c
            .get_volume(v1::GetVolumeRequest { id: "big".into() })
            .await
            .map(|r| r.into_inner());
        if let Ok(v) = v {
            if v.message.contains("erasing") {
                progress = Some(v.message);
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let progress = progress.context("no erase progress was seen in the volume's state")?;
    println!("while creating: {progress}");
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "bystander".into(),
        qos: Some(v1::QosLimits {
            read_iops: 1000,
            ..Default::default()
        }),
    })
    .await
    .context("a QoS change during the erase")?;
    c.get_volume(v1::GetVolumeRequest {
        id: "bystander".into(),
    })
    .await?;
    let metrics = d.scrape()?;
    ensure!(
        metrics.contains("ublkd_volumes"),
        "a scrape during the erase"
    );
    ensure!(
        !creating.is_finished(),
        "the create finished before the other calls answered: nothing was shown to run beside it"
    );
    let big = creating.await??.into_inner();
    ensure!(
        big.message.is_empty(),
        "READY with a message: {}",
        big.message
    );
    for id in ["big", "bystander"] {
        c.delete_volume(v1::DeleteVolumeRequest {
            id: id.into(),
            ..Default::default()
        })
        .await?;
    }
    d.stop_with(libc::SIGTERM)?;
    Ok(())
}

/// On a CPU declared dedicated, a worker spins before it sleeps unless told otherwise, and `poll
/// auto` polls; such a worker alone on CPU 1 serves a polled zero-copy volume with every byte
/// verified, and its requests reach it without interrupting it: the ring that carries its ublk
/// commands runs task work cooperatively, so the worker's CPU takes no reschedule IPI per
/// request. (Before the poll ring was COOP_TASKRUN it took 1.24 per I/O at QD1:
/// docs/performance.md, "Polling with a dedicated worker CPU".)
#[test]
fn a_dedicated_worker_spins_polls_and_takes_its_requests_without_a_reschedule_ipi() -> Result<()> {
    let dp = Handle::start(Config {
        cpus: vec![1],
        dedicated_cpus: true,
        ..Config::default()
    })?;
    let workers = dp.worker_stats()?;
    ensure!(
        workers.iter().all(|w| w.idle_spin == DEDICATED_SPIN),
        "workers on dedicated CPUs spin {DEDICATED_SPIN:?} unasked: {workers:?}"
    );
    let whole = BackendSpec::Nvme {
        path: PathBuf::from(NG),
        window: None,
        keep_data: false,
    };
    let info = dp.add_device(DeviceSpec {
        zero_copy: Toggle::On,
        ..guest::spec(whole, namespace_bytes()?, IoPath::Batch)
    })?;
    ensure!(info.polled && info.zero_copy, "polled zero copy: {info:?}");
    // CPU 1's reschedule IPIs (the RES line of /proc/interrupts, one column per CPU).
    let res_cpu1 = || -> Result<u64> {
        let all = std::fs::read_to_string("/proc/interrupts")?;
        let line = all.lines().find(|l| l.trim_start().starts_with("RES:"));
        let cpu1 = line.and_then(|l| l.split_whitespace().nth(2));
        Ok(cpu1.context("no RES line for CPU 1")?.parse()?)
    };
    let before = res_cpu1()?;
    let report = guest::fio(
        &info.block_device,
        &[
            "--rw=randread",
            "--bs=4k",
            "--iodepth=1",
            "--number_ios=3000",
            "--cpus_allowed=0",
        ],
    )?;
    let ipis = res_cpu1()? - before;
    let ios = report["jobs"][0]["read"]["total_ios"]
        .as_u64()
        .context("fio's read total_ios")?;
    println!("QD1 randread: {ios} I/Os, {ipis} reschedule IPIs on the worker's CPU");
    ensure!(ios >= 3000, "fio did {ios} I/Os");
    ensure!(
        ipis * 4 < ios,
        "{ipis} reschedule IPIs on the spinning worker's CPU for {ios} I/Os"
    );
    fio_verify(&info.block_device, "8m")?;
    let workers = dp.worker_stats()?;
    ensure!(
        workers.iter().any(|w| w.waits[0] > 0),
        "waits ended while the worker spun: {workers:?}"
    );
    ensure!(dp.stats(info.dev_id)?.total.errors == 0);
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    Ok(())
}
