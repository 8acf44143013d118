//! Volumes survive daemon crashes and restarts: ublkd takes the kernel devices over (user
//! recovery) with no I/O error and no data loss, finishes or undoes what a crash interrupted, and
//! reports ublk devices nobody owns.
#![cfg(feature = "vm")]

use anyhow::{bail, ensure, Context, Result};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use ublkd_proto::v1::{self, volume_spec::Backend};
use ublkd_tests::api::{self, create};
use ublkd_tests::daemon::{bin, sample, Daemon};
use ublkd_tests::guest;
use ublkd_tests::MIB;

/// Recovery volumes have two queues, so a takeover attaches more than one.
fn spec(size: u64, backend: Backend) -> v1::VolumeSpec {
    v1::VolumeSpec {
        queues: Some(2),
        ..api::volume(size, backend)
    }
}

fn file_backend(path: &Path) -> Backend {
    api::file(path, true)
}

/// fio writing with verification on a file system, in the background.
fn start_fio(dir: &Path, runtime: u32) -> Result<Child> {
    Ok(Command::new("fio")
        .args([
            "--name=torture",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bs=4k",
            "--size=48m",
            "--iodepth=16",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--verify_fatal=1",
            "--do_verify=1",
            "--time_based",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .current_dir(dir)
        .arg(format!("--runtime={runtime}"))
        .arg(format!("--directory={}", dir.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?)
}

/// The torture volumes' metrics (ids t...; for diagnosing a stall), via either daemon's port.
fn metrics_of_torture_volumes() -> String {
    // bash, for /dev/tcp.
    ublkd_tests::run(Command::new("bash").arg("-c").arg(
        "for p in 19591 19593; do exec 3<>/dev/tcp/127.0.0.1/$p 2>/dev/null || continue; \
         printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' >&3; grep 'volume=\"t' <&3; done; true",
    ))
    .unwrap_or_default()
}

/// Waits for the time-based fio to end on its own (by `deadline`) and returns its report;
/// anything but exit 0 (an I/O error, a verify failure) fails. No signal is sent: fio has been
/// seen to hang in a futex after SIGINT, with no I/O in flight anywhere.
fn finish_fio(fio: Child, deadline: Instant) -> Result<serde_json::Value> {
    // fio ends on time unless an I/O never completes: say which, don't hang.
    let pid = fio.id();
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        if Instant::now() > deadline {
            let diag = guest::sh(
                "cat /sys/block/ublkb*/inflight; ps -eLo pid,tid,stat,wchan:32,comm | grep -E ' D|fio'",
            )
            .unwrap_or_default();
            let diag = format!("{diag}\nublkd metrics:\n{}", metrics_of_torture_volumes());
            bail!("fio did not end on time (an I/O never completed?):\n{diag}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = fio.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "fio failed ({}): {}\n{}",
        out.status,
        stderr,
        text
    );
    ensure!(
        !stderr.contains("verify"),
        "fio reported a verify problem: {stderr}"
    );
    let (report, rest) = ublkd_tests::split_fio_json(&text)?;
    if !rest.is_empty() {
        println!("fio printed after its report: {rest}");
    }
    ensure!(
        !rest.contains("verify") && !rest.contains("error"),
        "fio reported a problem after its report: {rest}"
    );
    Ok(report)
}

/// Seconds each fio of a `Writer` runs. Short, so that the writer outlasts any number of
/// restarts on a slow guest and still ends soon after it is told to.
const SEGMENT_SECS: u32 = 5;

/// fio writing with verification in the background for as long as the restarts last: one
/// time-based fio after another (each ending by itself: no signal, see `finish_fio`), until told
/// to stop; the first that fails ends it.
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Result<Vec<serde_json::Value>>>,
}

impl Writer {
    fn start(dir: &Path) -> Writer {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let dir = dir.to_owned();
        let thread = std::thread::spawn(move || {
            let mut reports = Vec::new();
            loop {
                let fio = start_fio(&dir, SEGMENT_SECS)?;
                let deadline = Instant::now() + Duration::from_secs(u64::from(SEGMENT_SECS) + 60);
                let report = finish_fio(fio, deadline)
                    .with_context(|| format!("fio run {} of the writer", reports.len() + 1))?;
                reports.push(report);
                if flag.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(reports);
                }
            }
        });
        Writer { stop, thread }
    }

    /// Whether the writer has ended (only a failed fio ends it before `finish`).
    fn ended(&self) -> bool {
        self.thread.is_finished()
    }

    /// Lets the running fio end by itself and returns every report.
    fn finish(self) -> Result<Vec<serde_json::Value>> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        match self.thread.join() {
            Ok(r) => r,
            Err(_) => bail!("the fio writer thread panicked"),
        }
    }
}

/// Restarts ublkd under fio (20 times by kill -9, or 10 by SIGTERM with devices kept), a volume
/// of each of `kinds` at once (one daemon, one restart for all: the three backends' kill -9
/// runs were 140 s of the suite apart), then checks no fio saw an error or a verify failure, and
/// every file system is clean.
async fn torture(name: &str, port: u16, kinds: &[Kind], graceful: bool) -> Result<()> {
    let dir = guest::scratch(name)?;
    let mut d = Daemon::new(&dir, port, "")?;
    if graceful {
        d.env.push(("UBLKD_ON_EXIT".into(), "keep".into()));
    }
    d.start().await?;
    let mut vols = Vec::new();
    for kind in kinds {
        let id = kind.volume();
        let backend = match kind {
            Kind::File => file_backend(&d.root.join(format!("{id}.img"))),
            Kind::Ram => api::ram(),
            Kind::Nvme => Backend::Nvme(v1::NvmeBackend {
                device: "/dev/ng0n1".into(),
                offset_bytes: Some(512 * MIB),
                length_bytes: 128 * MIB,
                keep_data: false,
                identity: String::new(),
            }),
        };
        let mut vspec = spec(128 * MIB, backend);
        if *kind == Kind::Nvme {
            // Polled, as it says: auto would not poll on the guest's shared CPUs.
            vspec.poll = v1::Toggle::On.into();
        }
        let vol = d
            .volumes()
            .await?
            .create_volume(create(id, vspec))
            .await?
            .into_inner();
        let mnt = guest::scratch(&format!("{name}-{id}-mnt"))?;
        vols.push((id, vol.device_path, mnt));
    }
    let mut writers = Vec::new();
    let result = torture_cycles(&mut d, &vols, graceful, &mut writers).await;
    if let Err(e) = &result {
        // Said at once: the cleanup below may fail too, and must not hide why.
        eprintln!("torture failed: {e:#}");
    }
    // Whatever happened, leave nothing behind for the next test: no fio, no mount, no device.
    for w in writers {
        // Its verdict no longer counts: the test failed already; it must only end.
        let _ = w.finish();
    }
    for (_, _, mnt) in &vols {
        // Mounted only if the cycles failed before their own umount; else a no-op.
        let _ = guest::sh(&format!(
            "umount {0} 2>/dev/null || umount -l {0}",
            mnt.display()
        ));
    }
    if d.pid().is_none() {
        // A start that fails here leaves the deletes below to say so.
        let _ = d.start().await;
    }
    if result.is_err() {
        eprintln!("ublkd log:\n{}", d.log());
    }
    let mut fsck = Ok(());
    if result.is_ok() {
        for (_, dev, _) in &vols {
            fsck = fsck.and(guest::sh(&format!("fsck.ext4 -fn {dev}")).map(drop));
        }
    }
    let metrics = d.scrape().unwrap_or_default();
    let mut deleted = Ok(());
    for (id, _, _) in &vols {
        let del = d
            .volumes()
            .await?
            .delete_volume(v1::DeleteVolumeRequest {
                id: (*id).into(),
                allow_missing: true,
                delete_backing: false,
                force: false,
            })
            .await;
        deleted = deleted.and(del.map(drop));
    }
    result?;
    fsck?;
    deleted?;
    let recoveries = sample(&metrics, "ublkd_volume_recoveries_total", &[]).unwrap_or(0.0);
    ensure!(
        recoveries >= 1.0,
        "the last start took the devices over: {recoveries}"
    );
    for (id, _, _) in &vols {
        let protocol = sample(
            &metrics,
            "ublkd_volume_protocol_errors_total",
            &[("volume", id)],
        );
        ensure!(
            protocol == Some(0.0),
            "{id}: no ublk command failed unexpectedly: {protocol:?}"
        );
    }
    Ok(())
}

/// `vols`: each volume's id, device and mount point.
async fn torture_cycles(
    d: &mut Daemon,
    vols: &[(&str, String, std::path::PathBuf)],
    graceful: bool,
    writers: &mut Vec<Writer>,
) -> Result<()> {
    // A stop by SIGTERM takes one path every time; a kill lands anywhere, so it gets more.
    let cycles = if graceful { 10 } else { 20 };
    for (_, dev, mnt) in vols {
        guest::sh(&format!(
            "mkfs.ext4 -q -F {dev} && mount {dev} {}",
            mnt.display()
        ))?;
        // fio writes and verifies for as long as the cycles take, however slow the guest: one
        // short time-based run after another (`Writer`). Only a failed fio ends it early.
        writers.push(Writer::start(mnt));
    }
    let mut longest = Duration::ZERO;
    for cycle in 0..cycles {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let started = Instant::now();
        if graceful {
            let st = d.stop_with(libc::SIGTERM)?;
            ensure!(
                st.success(),
                "cycle {cycle}: graceful exit failed: {st}\n{}",
                d.log()
            );
        } else {
            d.stop_with(libc::SIGKILL)?;
        }
        for (_, dev, _) in vols {
            ensure!(
                Path::new(dev).exists(),
                "cycle {cycle}: {dev} must survive the daemon"
            );
        }
        d.start().await?;
        let ready = d.wait_all_ready().await?;
        longest = longest.max(started.elapsed());
        for (id, dev, _) in vols {
            ensure!(
                ready.len() == vols.len()
                    && ready.iter().any(|v| v.id == *id && v.device_path == *dev),
                "cycle {cycle}: {id} keeps its device {dev}: {ready:?}"
            );
        }
        if let Some(i) = writers.iter().position(Writer::ended) {
            let w = writers.remove(i);
            let why = match w.finish() {
                Err(e) => format!("{e:#}"),
                Ok(_) => "it stopped unasked".into(),
            };
            bail!("cycle {cycle}: fio on {} ended early: {why}", vols[i].0);
        }
    }
    let how = if graceful { "SIGTERM" } else { "kill -9" };
    println!("{cycles} restarts ({how}), longest until serving again: {longest:?}");
    // The last fio ends on the final daemon; then the verdict of every one.
    for (i, w) in std::mem::take(writers).into_iter().enumerate() {
        let id = vols[i].0;
        let reports = w.finish().with_context(|| format!("fio on {id}"))?;
        let errors: u64 = reports.iter().map(ublkd_tests::fio_errors).sum();
        ensure!(errors == 0, "fio on {id} saw {errors} errors");
        let written: u64 = reports
            .iter()
            .map(|r| r["jobs"][0]["write"]["io_bytes"].as_u64().unwrap_or(0))
            .sum();
        println!(
            "{id}: {} fio runs wrote {written} bytes across the restarts",
            reports.len()
        );
        ensure!(
            written > 8 * MIB,
            "fio on {id} made progress across the restarts: {written} bytes"
        );
    }
    for (_, _, mnt) in vols {
        guest::sh(&format!("umount {}", mnt.display()))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_fio_on_ext4_on_file_ram_and_nvme_volumes_loses_nothing() -> Result<()> {
    torture("tkill", 19591, &[Kind::File, Kind::Ram, Kind::Nvme], false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_restarts_keep_devices_and_lose_nothing() -> Result<()> {
    torture("tgrace", 19593, &[Kind::Ram], true).await
}

/// The backend a torture test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Ram,
    /// A window of the guest's NVMe namespace, polled, zero copy.
    Nvme,
}

impl Kind {
    /// The id of its volume in a torture test.
    fn volume(self) -> &'static str {
        match self {
            Kind::File => "tfile",
            Kind::Ram => "tram",
            Kind::Nvme => "tnvme",
        }
    }
}

/// Registry and kernel agree: every registered volume is READY on a device this daemon serves
/// with its recorded id, and no ublk device is left without an owner.
async fn assert_agreement(d: &Daemon) -> Result<Vec<v1::Volume>> {
    let vols = d.wait_all_ready().await?;
    let node = d
        .node()
        .await?
        .get_node_info(v1::GetNodeInfoRequest {})
        .await?
        .into_inner();
    ensure!(
        node.orphans.is_empty(),
        "orphans after restart: {:?}",
        node.orphans
    );
    let mut kernel: Vec<String> = guest::ublk_char_devices()?;
    kernel.sort();
    let mut registered: Vec<String> = vols.iter().map(|v| format!("ublkc{}", v.dev_id)).collect();
    registered.sort();
    ensure!(
        kernel == registered,
        "kernel {kernel:?} vs registry {registered:?}"
    );
    for v in &vols {
        let size: u64 =
            ublkd_tests::read_trimmed(format!("/sys/block/ublkb{}/size", v.dev_id))?.parse()?;
        let want = v.spec.as_ref().map_or(0, |s| s.size_bytes);
        ensure!(
            size * 512 == want,
            "{}: kernel size {} vs registry {want}",
            v.id,
            size * 512
        );
    }
    Ok(vols)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_inside_create_resize_and_delete_leave_registry_and_kernel_agreeing() -> Result<()>
{
    let dir = guest::scratch("faults")?;
    let mut d = Daemon::new(&dir, 19594, "")?;
    let points = [
        ("create:before_record", "create"),
        ("create:after_record", "create"),
        ("create:after_device", "create"),
        ("resize:after_record", "resize"),
        ("resize:after_device", "resize"),
        ("delete:after_mark", "delete"),
        ("delete:after_device", "delete"),
    ];
    for (i, (point, op)) in points.iter().enumerate() {
        // A volume to resize or delete, made without a fault.
        d.env.clear();
        d.start().await?;
        let mut c = d.volumes().await?;
        let id = format!("f{i}");
        if *op != "create" {
            c.create_volume(create(&id, spec(64 * MIB, api::ram())))
                .await?;
        }
        d.stop_with(libc::SIGTERM)?;
        d.env = vec![("UBLKD_TEST_FAULTS".into(), format!("abort_at={point}"))];
        d.start().await?;
        d.wait_all_ready().await?;
        let mut c = d.volumes().await?;
        let result = match *op {
            "create" => c
                .create_volume(create(&id, spec(64 * MIB, api::ram())))
                .await
                .map(drop),
            "resize" => c
                .resize_volume(v1::ResizeVolumeRequest {
                    id: id.clone(),
                    size_bytes: 96 * MIB,
                })
                .await
                .map(drop),
            _ => c
                .delete_volume(v1::DeleteVolumeRequest {
                    id: id.clone(),
                    allow_missing: false,
                    delete_backing: false,
                    force: false,
                })
                .await
                .map(drop),
        };
        ensure!(result.is_err(), "{point}: the daemon died mid-call");
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.exited()?.is_none() {
            ensure!(Instant::now() < deadline, "{point}: the daemon did not die");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        d.env.clear();
        d.start().await?;
        let vols = assert_agreement(&d)
            .await
            .with_context(|| format!("after {point}"))?;
        let has = vols.iter().any(|v| v.id == id);
        match *point {
            "create:before_record" => {
                ensure!(!has, "{point}: nothing was recorded, nothing exists")
            }
            "create:after_record" | "create:after_device" => {
                ensure!(has, "{point}: the recorded volume exists")
            }
            "resize:after_record" | "resize:after_device" => {
                let v = vols.iter().find(|v| v.id == id).context("resized volume")?;
                ensure!(
                    v.spec.as_ref().map(|s| s.size_bytes) == Some(96 * MIB),
                    "{point}: the recorded resize is applied"
                );
            }
            _ => ensure!(!has, "{point}: the started delete is finished"),
        }
        println!(
            "{point}: registry and kernel agree ({} volumes)",
            vols.len()
        );
        d.stop_with(libc::SIGTERM)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_devices_are_reported_then_adopted_or_deleted() -> Result<()> {
    let dir = guest::scratch("orphan")?;
    // Two devices made outside the daemon, whose server then dies.
    let mut orphans = Vec::new();
    for _ in 0..2 {
        let mut run = Command::new(bin("ublkd"))
            .args([
                "run",
                "--size",
                "64MiB",
                "--backend",
                "null",
                "--queues",
                "1",
                "--depth",
                "32",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        let out = run.stdout.take().context("stdout")?;
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)?;
        let dev = line
            .trim()
            .strip_prefix("READY ")
            .context("READY line")?
            .to_owned();
        run.kill()?;
        run.wait()?;
        let id: u32 = dev.trim_start_matches("/dev/ublkb").parse()?;
        orphans.push((id, dev));
    }
    let mut d = Daemon::new(&dir, 19595, "")?;
    d.start().await?;
    let mut node = d.node().await?;
    let info = node
        .get_node_info(v1::GetNodeInfoRequest {})
        .await?
        .into_inner();
    let seen: Vec<u32> = info.orphans.iter().map(|o| o.dev_id).collect();
    for (id, _) in &orphans {
        ensure!(
            seen.contains(id),
            "orphan {id} reported: {:?}",
            info.orphans
        );
    }
    ensure!(
        Path::new(&orphans[0].1).exists(),
        "never silently destroyed"
    );
    let metrics = d.scrape()?;
    ensure!(
        sample(&metrics, "ublkd_orphan_devices", &[]) == Some(2.0),
        "orphan metric"
    );
    // Adopt the first: same device node, now a volume that serves I/O.
    let (id0, dev0) = &orphans[0];
    let v = node
        .adopt_device(v1::AdoptDeviceRequest {
            dev_id: *id0,
            id: "adopted".into(),
            spec: Some(v1::VolumeSpec {
                backend: Some(api::ram()),
                ..Default::default()
            }),
        })
        .await?
        .into_inner();
    ensure!(
        &v.device_path == dev0 && v.state == v1::VolumeState::Ready as i32,
        "{v:?}"
    );
    guest::sh(&format!(
        "dd if=/dev/zero of={dev0} bs=4k count=64 oflag=direct status=none"
    ))?;
    // Delete the second.
    let (id1, dev1) = &orphans[1];
    node.delete_orphan(v1::DeleteOrphanRequest { dev_id: *id1 })
        .await?;
    guest::wait_gone(Path::new(dev1), Duration::from_secs(5))?;
    // A registered volume's device is not an orphan and cannot be deleted as one.
    let e = node
        .delete_orphan(v1::DeleteOrphanRequest { dev_id: *id0 })
        .await
        .expect_err("not an orphan");
    ensure!(e.code() == tonic::Code::NotFound, "{e:?}");
    let info = node
        .get_node_info(v1::GetNodeInfoRequest {})
        .await?
        .into_inner();
    ensure!(info.orphans.is_empty(), "{:?}", info.orphans);
    Ok(())
}

/// A volume that is not served right now still owns its NVMe window (issue 22, item 4): after
/// a kill -9 the takeover of "z" fails (hook), and while it is FAILED neither a resize of "a"
/// into its window nor a new window over it is allowed: FAILED_PRECONDITION naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_neighbours_nvme_window_is_never_taken() -> Result<()> {
    let dir = guest::scratch("recovery-window-owner")?;
    let mut d = Daemon::new(&dir, 19615, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let window = |offset: u64, len: u64| {
        let mut s = api::volume(len, api::nvme("/dev/ng0n1", offset, len));
        s.queues = Some(1);
        s
    };
    c.create_volume(api::create("a", window(0, 32 * MIB)))
        .await?;
    c.create_volume(api::create("z", window(64 * MIB, 32 * MIB)))
        .await?;
    d.stop_with(9)?;
    // "a" is taken over first (ids in order) and goes through; every takeover of "z" fails.
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "recover_after_start=1000000@1".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let vols = c
            .list_volumes(v1::ListVolumesRequest {})
            .await?
            .into_inner()
            .volumes;
        let state = |id: &str| vols.iter().find(|v| v.id == id).map(|v| v.state());
        if state("a") == Some(v1::VolumeState::Ready) && state("z") == Some(v1::VolumeState::Failed)
        {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "wanted a READY and z FAILED: {vols:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = c
        .resize_volume(v1::ResizeVolumeRequest {
            id: "a".into(),
            size_bytes: 80 * MIB,
        })
        .await
        .expect_err("a grows into z's window");
    println!("resize into a FAILED neighbour: {e:?}");
    ensure!(
        e.code() == tonic::Code::FailedPrecondition && e.message().contains("\"z\""),
        "{e:?}"
    );
    let e = c
        .create_volume(api::create("n", window(72 * MIB, 8 * MIB)))
        .await
        .expect_err("a new window over z's");
    ensure!(
        e.code() == tonic::Code::FailedPrecondition && e.message().contains("\"z\""),
        "{e:?}"
    );
    // A window placed by ublkd goes around both.
    let mut placed = api::volume(16 * MIB, api::nvme("/dev/ng0n1", 0, 0));
    if let Some(v1::volume_spec::Backend::Nvme(n)) = &mut placed.backend {
        n.offset_bytes = None;
    }
    let p = c
        .create_volume(api::create("p", placed))
        .await?
        .into_inner();
    let at = match p.spec.and_then(|s| s.backend) {
        Some(v1::volume_spec::Backend::Nvme(n)) => (n.offset_bytes, n.length_bytes),
        other => anyhow::bail!("{other:?}"),
    };
    ensure!(at == (Some(32 * MIB), 16 * MIB), "placed at {at:?}");
    Ok(())
}

/// The process whose mount namespace holds a mount: killed (and the mount with it) when dropped,
/// also when the test fails half way.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill(); // It may have exited already; wait() reaps it either way.
        let _ = self.0.wait(); // Nothing to report about a sleep that was killed.
    }
}

/// Deleting a volume whose device is not being served (its takeover failed after a kill -9)
/// still checks the kernel device for holders (issue 22, item 5): while another mount
/// namespace has it mounted the delete is FAILED_PRECONDITION and the backing file and mount
/// stay; once unmounted, the delete removes the device and the file and leaves no orphan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_not_served_is_not_deleted_from_under_its_mount() -> Result<()> {
    let dir = guest::scratch("recovery-delete-held")?;
    let mut d = Daemon::new(&dir, 19616, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let backing = d.root.join("held.img");
    let mut s = api::volume(64 * MIB, api::file(&backing, true));
    s.queues = Some(1);
    let vol = c.create_volume(create("held", s)).await?.into_inner();
    let dev = vol.device_path.clone();
    guest::sh(&format!("mkfs.ext4 -q {dev}"))?;
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    // Read-only without the journal: unmounting it later writes nothing to the device.
    let mut holder = Holder(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "mount -t ext4 -o ro,noload {dev} {m} && echo mounted && exec sleep 600",
                m = mnt.display()
            ))
            .stdout(Stdio::piped())
            .spawn()?,
    );
    {
        use std::io::BufRead;
        let out = holder.0.stdout.take().context("holder stdout")?;
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line)?;
        ensure!(
            line.trim() == "mounted",
            "the other namespace did not mount: {line:?}"
        );
    }
    let holder_pid = holder.0.id();
    d.stop_with(9)?;
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "recover_after_start=1000000".into(),
    )];
    d.start().await?;
    let mut c = d.volumes().await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = c
            .get_volume(v1::GetVolumeRequest { id: "held".into() })
            .await?
            .into_inner();
        if v.state() == v1::VolumeState::Failed {
            println!("takeover failed as forced: {}", v.message);
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the takeover never failed: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let delete = || v1::DeleteVolumeRequest {
        id: "held".into(),
        delete_backing: true,
        ..Default::default()
    };
    let e = c
        .delete_volume(delete())
        .await
        .expect_err("a mounted device is not deleted");
    println!("delete while mounted elsewhere: {e:?}");
    ensure!(e.code() == tonic::Code::FailedPrecondition, "{e:?}");
    ensure!(backing.exists(), "the backing file is still there");
    let mounts = std::fs::read_to_string(format!("/proc/{holder_pid}/mountinfo"))?;
    ensure!(
        mounts.contains(&mnt.display().to_string()),
        "the other namespace's mount is still there"
    );
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.delete_volume(delete()).await {
            Ok(_) => break,
            Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                // The namespace's unmount may take a moment after its last process.
                ensure!(
                    Instant::now() < deadline,
                    "still refused once unmounted: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => bail!("delete once unmounted: {e:?}"),
        }
    }
    ensure!(!backing.exists(), "the backing file was removed");
    guest::wait_gone(Path::new(&dev), Duration::from_secs(10))?;
    let orphans = d.orphans().await?;
    ensure!(orphans.is_empty(), "devices left: {orphans:?}");
    Ok(())
}
