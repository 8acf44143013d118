//! Fault paths, each forced (dataplane test hooks, `test-hooks` feature): a failure may cost a
//! request or a volume its service, never a device, a leaked kernel device, a hung task or the
//! daemon.
#![cfg(feature = "vm")]

use anyhow::{ensure, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use ublkd_dataplane::hooks::{self, Fault};
use ublkd_dataplane::{BackendSpec, DataplaneError, ErrorKind, IoPath, Toggle};
use ublkd_proto::v1;
use ublkd_tests::daemon::{sample, Daemon};
use ublkd_tests::guest;
use ublkd_tests::{api, MIB};

/// No ublk device is left in the kernel and no task hangs (io_uring's exit work, which runs
/// in D state for a moment after a ring closes, is given 10 s to finish).
fn assert_clean() -> Result<()> {
    let left = guest::ublk_char_devices()?;
    ensure!(left.is_empty(), "ublk devices left behind: {left:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = guest::d_state_tasks();
        if d.is_empty() {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "tasks in D state: {d:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_partially_refused_batch_commit_drops_only_the_refused_element() -> Result<()> {
    let dp = guest::dataplane()?;
    let info = dp.add_device(guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Batch))?;
    // Every refused commit before the fix re-sent the refused element (refused again) or
    // dropped the valid ones after it: fio would hang on requests never completed.
    hooks::arm(Fault::CommitBadElement, 20);
    guest::fio(
        &info.block_device,
        &[
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--numjobs=2",
            "--size=100%",
            "--io_size=16m",
            "--group_reporting",
        ],
    )?;
    let fired_all = !hooks::fire(Fault::CommitBadElement);
    hooks::arm(Fault::CommitBadElement, 0);
    let stats = dp.stats(info.dev_id)?;
    println!(
        "refused commit elements: {} (protocol errors), errors {}",
        stats.total.protocol_errors, stats.total.errors
    );
    ensure!(fired_all, "the hook fired 20 times under fio");
    ensure!(
        stats.total.protocol_errors == 20,
        "each refused element counted once: {stats:?}"
    );
    ensure!(stats.total.errors == 0, "{stats:?}");
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    assert_clean()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn volume(size: u64, backend: v1::volume_spec::Backend, depth: u32) -> v1::VolumeSpec {
    v1::VolumeSpec {
        queues: Some(1),
        queue_depth: Some(depth),
        ..api::volume(size, backend)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ram_volume_memory_is_measured_in_constant_time() -> Result<()> {
    use v1::volume_spec::Backend;
    let dir = guest::scratch("rammem")?;
    let mut d = Daemon::new(&dir, 19601, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let ram = api::ram;
    // 16 TiB: measuring it page by page allocated 16 GiB and aborted ublkd on the first scrape.
    c.create_volume(v1::CreateVolumeRequest {
        id: "huge".into(),
        spec: Some(volume(16 << 40, ram(), 32)),
    })
    .await?;
    let small = c
        .create_volume(v1::CreateVolumeRequest {
            id: "small".into(),
            spec: Some(volume(64 * MIB, ram(), 32)),
        })
        .await?
        .into_inner();
    guest::sh(&format!(
        "dd if=/dev/urandom of={} bs=1M count=8 oflag=direct status=none",
        small.device_path
    ))?;
    let text = d.scrape()?;
    let mem = |id: &str| sample(&text, "ublkd_volume_memory_bytes", &[("volume", id)]);
    println!("memory: small {:?}, huge {:?}", mem("small"), mem("huge"));
    ensure!(
        mem("small").is_some_and(|b| (8 * MIB) as f64 <= b && b < (9 * MIB) as f64),
        "8 MiB written, 8 MiB counted: {:?}",
        mem("small")
    );
    // Nothing written; the kernel's partition scan read a few pages, which tmpfs allocates.
    ensure!(
        mem("huge").is_some_and(|b| b < MIB as f64),
        "nothing written to huge: {:?}",
        mem("huge")
    );
    // 100 volumes of every backend: scrapes stay cheap and RSS does not grow with them.
    for i in 0..98u32 {
        let backend = match i % 3 {
            0 => Backend::Null(v1::NullBackend {}),
            1 => ram(),
            _ => Backend::File(v1::FileBackend {
                path: d.root.join(format!("f{i}.img")).display().to_string(),
                create: true,
            }),
        };
        c.create_volume(v1::CreateVolumeRequest {
            id: format!("v{i}"),
            spec: Some(volume(64 * MIB, backend, 16)),
        })
        .await?;
    }
    let pid = d.pid().unwrap_or(0);
    let rss_before = rss_kib(pid);
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let text = d.scrape()?;
        slowest = slowest.max(t.elapsed());
        ensure!(
            sample(&text, "ublkd_volumes", &[]) == Some(100.0),
            "100 volumes"
        );
    }
    let rss_after = rss_kib(pid);
    println!(
        "100 volumes: slowest of 5 scrapes {:.1} ms; RSS {rss_before} KiB -> {rss_after} KiB",
        slowest.as_secs_f64() * 1e3
    );
    ensure!(
        rss_after < rss_before + 16 * 1024,
        "scrapes allocate nothing that stays: {rss_before} -> {rss_after} KiB"
    );
    ensure!(d.exited()?.is_none(), "ublkd is alive: {}", d.log());
    d.stop_with(libc::SIGTERM)?;
    assert_clean()
}

/// Polls the volumes until `done` holds for `id`, recording every state seen and checking on
/// each pass that the block device `dev` still exists (a takeover must never delete it).
async fn watch_volume(
    d: &Daemon,
    id: &str,
    dev: &str,
    done: impl Fn(&v1::Volume) -> bool,
) -> Result<(v1::Volume, Vec<(i32, String)>)> {
    let mut c = d.volumes().await?;
    let mut seen: Vec<(i32, String)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        ensure!(
            std::path::Path::new(dev).exists(),
            "{dev} vanished; states seen: {seen:?}\n{}",
            d.log()
        );
        if let Ok(v) = c.get_volume(v1::GetVolumeRequest { id: id.into() }).await {
            let v = v.into_inner();
            if seen.last().is_none_or(|(s, _)| *s != v.state) {
                seen.push((v.state, v.message.clone()));
            }
            if done(&v) {
                return Ok((v, seen));
            }
        }
        ensure!(
            Instant::now() < deadline,
            "{id} never got there; states seen: {seen:?}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_takeover_keeps_the_device_and_resumes() -> Result<()> {
    let dir = guest::scratch("takeover")?;
    let mut d = Daemon::new(&dir, 19602, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let img = d.root.join("t.img");
    let vol = c
        .create_volume(v1::CreateVolumeRequest {
            id: "t".into(),
            spec: Some(v1::VolumeSpec {
                size_bytes: 64 * MIB,
                backend: Some(v1::volume_spec::Backend::File(v1::FileBackend {
                    path: img.display().to_string(),
                    create: true,
                })),
                queues: Some(2),
                queue_depth: Some(32),
                ..Default::default()
            }),
        })
        .await?
        .into_inner();
    let dev = vol.device_path.clone();
    let pattern = dir.join("pattern");
    guest::sh(&format!(
        "head -c 4194304 /dev/urandom > {p} && dd if={p} of={dev} bs=1M oflag=direct status=none",
        p = pattern.display()
    ))?;
    d.stop_with(libc::SIGKILL)?;
    // A reader that arrives while nobody serves waits (quiesced) and must finish without error
    // once the device is served again.
    let back = dir.join("back");
    let reader = std::process::Command::new("dd")
        .args([
            format!("if={dev}"),
            format!("of={}", back.display()),
            "bs=1M".into(),
            "count=4".into(),
            "iflag=direct".into(),
            "status=none".into(),
        ])
        .spawn()?;
    // START_USER_RECOVERY is busy three times (retried at once), then the last queue's attach
    // fails twice: the first attempt and the first retry fail, the second retry resumes.
    d.env = vec![(
        "UBLKD_TEST_FAULTS".into(),
        "recover_busy=3,recover_after_start=2".into(),
    )];
    d.start().await?;
    let ready = v1::VolumeState::Ready as i32;
    let failed = v1::VolumeState::Failed as i32;
    let (v, seen) = watch_volume(&d, "t", &dev, |v| v.state == ready).await?;
    println!("states seen during the takeover: {seen:?}");
    ensure!(
        seen.iter()
            .any(|(s, m)| *s == failed && m.contains("test hook")),
        "the failed attempts were visible as FAILED with the reason: {seen:?}"
    );
    ensure!(v.device_path == dev, "same device: {v:?}");
    let out = reader.wait_with_output()?;
    ensure!(out.status.success(), "the waiting reader got an error");
    ensure!(
        std::fs::read(&back)? == std::fs::read(&pattern)?,
        "the reader got the data written before the crash"
    );
    let mut n = d.node().await?;
    let info = n
        .get_node_info(v1::GetNodeInfoRequest {})
        .await?
        .into_inner();
    ensure!(info.orphans.is_empty(), "no orphans: {:?}", info.orphans);
    guest::fio(
        std::path::Path::new(&dev),
        &["--rw=randrw", "--bs=4k", "--size=16m", "--iodepth=16"],
    )?;
    d.stop_with(libc::SIGTERM)?;
    assert_clean()
}

/// A delete whose DEL_DEV fails leaves the device stopped in the kernel but out of the
/// dataplane's maps. The retry must find it there and delete it, not call it gone and drop the
/// record over a `/dev/ublkcN` nobody owns any more (issue 38, defect 9).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_del_dev_failed_finishes_on_its_retry() -> Result<()> {
    let dir = guest::scratch("deldev")?;
    let mut d = Daemon::new(&dir, 19604, "")?;
    d.env = vec![("UBLKD_TEST_FAULTS".into(), "del_dev_fails=1".into())];
    d.start().await?;
    let mut c = d.volumes().await?;
    let vol = c
        .create_volume(v1::CreateVolumeRequest {
            id: "dd".into(),
            spec: Some(volume(
                16 * MIB,
                v1::volume_spec::Backend::Null(v1::NullBackend {}),
                32,
            )),
        })
        .await?
        .into_inner();
    let cdev = vol.device_path.replace("ublkb", "ublkc");
    let delete = || v1::DeleteVolumeRequest {
        id: "dd".into(),
        ..Default::default()
    };
    let first = c.delete_volume(delete()).await;
    ensure!(
        first.is_err(),
        "the first delete fails by the hook: {first:?}"
    );
    ensure!(
        std::path::Path::new(&cdev).exists(),
        "{cdev} is still in the kernel after the failed DEL_DEV"
    );
    c.delete_volume(delete()).await?;
    guest::wait_gone(std::path::Path::new(&cdev), Duration::from_secs(10))?;
    let listed = c
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner()
        .volumes;
    ensure!(listed.is_empty(), "the volume is gone: {listed:?}");
    let info = d
        .node()
        .await?
        .get_node_info(v1::GetNodeInfoRequest {})
        .await?
        .into_inner();
    ensure!(info.orphans.is_empty(), "no orphans: {:?}", info.orphans);
    d.stop_with(libc::SIGTERM)?;
    assert_clean()
}

#[test]
fn a_failed_attach_leaves_no_device_behind() -> Result<()> {
    let dp = guest::dataplane()?;
    for path in guest::PATHS {
        // The second queue's attach fails after the first queue was attached and armed.
        let mut spec = guest::spec(BackendSpec::Null, 16 * MIB, path);
        spec.queues = 2;
        hooks::arm(Fault::AttachFails, 1);
        let err = match dp.add_device(spec.clone()) {
            Ok(info) => anyhow::bail!("add_device succeeded despite the fault: {info:?}"),
            Err(e) => e,
        };
        println!("{path:?}: {err}");
        ensure!(
            matches!(err, DataplaneError::Attach { .. }),
            "the attach failure is reported as such: {err:?}"
        );
        ensure!(dp.list()?.is_empty(), "no device is served");
        assert_clean()?;
        // The dataplane still works.
        let info = dp.add_device(spec)?;
        guest::fio(
            &info.block_device,
            &["--rw=randrw", "--bs=4k", "--size=8m", "--iodepth=8"],
        )?;
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    assert_clean()
}

#[test]
fn deep_copying_queues_fit_their_buffer_registration() -> Result<()> {
    // Depth 4096 with 32 MiB requests would need 128 GiB of copy buffers registered as one
    // fixed buffer; io_uring refuses more than 1 GiB. The request size is capped instead.
    let dir = guest::scratch("deep")?;
    let size = 64 * MIB;
    let backing = guest::backing_file(&dir, "deep.img", size)?;
    let dp = guest::dataplane()?;
    for path in guest::PATHS {
        let mut spec = guest::spec(
            BackendSpec::File {
                path: backing.clone(),
            },
            size,
            path,
        );
        spec.queues = 1;
        spec.queue_depth = 4096;
        spec.max_io_bytes = 32 << 20;
        spec.zero_copy = ublkd_dataplane::Toggle::Off;
        let info = dp.add_device(spec)?;
        println!(
            "{path:?}: max I/O {} KiB at depth 4096",
            info.spec.max_io_bytes >> 10
        );
        ensure!(u64::from(info.spec.max_io_bytes) * 4096 <= 1 << 30);
        guest::fio(
            &info.block_device,
            &[
                "--rw=randwrite",
                "--bsrange=4k-1m",
                "--iodepth=64",
                "--size=100%",
                "--io_size=32m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
            ],
        )?;
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    assert_clean()
}

#[test]
fn transient_ring_errors_are_waited_out() -> Result<()> {
    let dp = guest::dataplane()?;
    let info = dp.add_device(guest::spec(BackendSpec::Null, 64 * MIB, IoPath::Batch))?;
    hooks::arm(Fault::RingTransient, 20);
    guest::fio(
        &info.block_device,
        &["--rw=randrw", "--bs=4k", "--iodepth=16", "--io_size=16m"],
    )?;
    let consumed = !hooks::fire(Fault::RingTransient);
    hooks::arm(Fault::RingTransient, 0);
    let workers = dp.worker_stats()?;
    let retries: u64 = workers.iter().map(|w| w.ring_retries).sum();
    println!("ring retries: {retries}");
    ensure!(consumed, "all 20 transient errors were injected");
    ensure!(retries == 20, "each counted once: {workers:?}");
    ensure!(
        workers.iter().all(|w| w.down_errno.is_none()),
        "every worker still serves: {workers:?}"
    );
    dp.delete_device(info.dev_id)?;
    dp.shutdown()?;
    assert_clean()
}

/// fio writing `io_size` bytes of 4 KiB random writes to `dev` and verifying them (crc32c), in
/// the background: what a failure and the takeover after it must not corrupt.
fn verifying_writer(dev: &str, io_size: u64) -> Result<std::process::Child> {
    Ok(std::process::Command::new("fio")
        .args([
            "--name=w",
            &format!("--filename={dev}"),
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=100%",
            &format!("--io_size={}m", io_size / MIB),
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?)
}

/// ublkd killed and started again without faults: it takes `dev` over (the same device), the
/// kernel reissues what it held, and `fio` finishes with its data verified.
async fn taken_over_verifies(d: &mut Daemon, dev: &str, fio: std::process::Child) -> Result<()> {
    d.stop_with(libc::SIGKILL)?;
    d.env.clear();
    d.start().await?;
    let vols = d.wait_all_ready().await?;
    ensure!(vols[0].device_path == dev, "same device: {vols:?}");
    let out = fio.wait_with_output()?;
    ensure!(
        out.status.success(),
        "fio verify across the takeover: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// A batch commit whose element the kernel refuses leaves that element's request with the
/// kernel: the volume turns FAILED, saying why, instead of staying READY with a request that
/// never completes (issue 55, review L8). The hook sends one tag twice in a commit; the kernel
/// refuses the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_commit_element_fails_the_volume_visibly() -> Result<()> {
    let dir = guest::scratch("commitrefused")?;
    let mut d = Daemon::new(&dir, 19605, "")?;
    d.env = vec![("UBLKD_TEST_FAULTS".into(), "commit_bad_element=1@50".into())];
    d.start().await?;
    let mut c = d.volumes().await?;
    let vol = c
        .create_volume(v1::CreateVolumeRequest {
            id: "b".into(),
            spec: Some(v1::VolumeSpec {
                io_path: v1::IoPath::Batch as i32,
                ..volume(64 * MIB, api::ram(), 32)
            }),
        })
        .await?
        .into_inner();
    let dev = vol.device_path.clone();
    let fio = verifying_writer(&dev, 16 * MIB)?;
    let failed = v1::VolumeState::Failed as i32;
    let (v, _) = watch_volume(&d, "b", &dev, |v| v.state == failed).await?;
    println!("FAILED: {}", v.message);
    ensure!(
        v.message.contains("refused the completion"),
        "the reason is given: {v:?}"
    );
    let proto = sample(
        &d.scrape()?,
        "ublkd_volume_protocol_errors_total",
        &[("volume", "b")],
    );
    ensure!(
        proto == Some(1.0),
        "the refused element is counted once: {proto:?}"
    );
    // A restart takes the device over and the kernel reissues what it holds: fio finishes
    // with its data verified.
    taken_over_verifies(&mut d, &dev, fio).await?;
    d.stop_with(libc::SIGTERM)?;
    assert_clean()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_ring_error_fails_the_volume_visibly_and_a_restart_recovers_it() -> Result<()> {
    let dir = guest::scratch("ringfatal")?;
    let mut d = Daemon::new(&dir, 19603, "")?;
    // One worker's ring fails for good a while into the I/O below.
    d.env = vec![("UBLKD_TEST_FAULTS".into(), "ring_fatal=1@300".into())];
    d.start().await?;
    let mut c = d.volumes().await?;
    let vol = c
        .create_volume(v1::CreateVolumeRequest {
            id: "r".into(),
            spec: Some(v1::VolumeSpec {
                size_bytes: 64 * MIB,
                backend: Some(api::ram()),
                queues: Some(2),
                queue_depth: Some(32),
                ..Default::default()
            }),
        })
        .await?
        .into_inner();
    let dev = vol.device_path.clone();
    let fio = verifying_writer(&dev, 32 * MIB)?;
    let failed = v1::VolumeState::Failed as i32;
    let (v, _) = watch_volume(&d, "r", &dev, |v| v.state == failed).await?;
    println!("FAILED: {}", v.message);
    ensure!(
        v.message.contains("worker") && v.message.contains("stopped"),
        "the reason is given: {v:?}"
    );
    let text = d.scrape()?;
    let up: Vec<Option<f64>> = ["0", "1"]
        .iter()
        .map(|w| sample(&text, "ublkd_worker_up", &[("worker", w)]))
        .collect();
    println!("ublkd_worker_up: {up:?}");
    ensure!(
        up.contains(&Some(0.0)) && up.contains(&Some(1.0)),
        "one worker down, one up: {up:?}"
    );
    // Each worker runs pinned to its CPU, and the clean-up counters are there to be read
    // (the control thread's too), at zero: nothing here failed to tidy up.
    for w in ["0", "1"] {
        let pinned = sample(&text, "ublkd_worker_pinned", &[("worker", w)]);
        ensure!(pinned == Some(1.0), "worker {w} pinned: {pinned:?}");
    }
    for (w, step) in [
        ("0", "wake"),
        ("1", "fetch_rearm"),
        ("control", "del_dev_async"),
    ] {
        let n = sample(
            &text,
            "ublkd_worker_cleanup_errors_total",
            &[("worker", w), ("step", step)],
        );
        ensure!(n == Some(0.0), "clean-up errors of {w}, {step}: {n:?}");
    }
    ensure!(d.exited()?.is_none(), "ublkd is alive");
    // The requests the dead worker held wait in the kernel; a restart takes the device over
    // and the kernel reissues them: fio finishes with its data verified.
    taken_over_verifies(&mut d, &dev, fio).await?;
    d.stop_with(libc::SIGTERM)?;
    assert_clean()
}

#[test]
fn zero_copy_volumes_beyond_the_buffer_slots_are_refused_not_silently_copied() -> Result<()> {
    // 2 workers x 16384 buffer slots = 128 volumes x 2 queues x depth 128, exactly.
    let dir = guest::scratch("slots")?;
    let dp = guest::dataplane()?;
    let mut served = Vec::new();
    let mut refused = 0;
    // Eight past the slots: each refused as the first was.
    for i in 0..136u32 {
        let path = guest::backing_file(&dir, &format!("s{i}.img"), 16 * MIB)?;
        let spec = ublkd_dataplane::DeviceSpec {
            queues: 2,
            queue_depth: 128,
            zero_copy: ublkd_dataplane::Toggle::On,
            ..guest::spec(
                BackendSpec::File { path },
                16 * MIB,
                guest::PATHS[i as usize % 2],
            )
        };
        match dp.add_device(spec) {
            Ok(info) => {
                ensure!(
                    info.zero_copy_in_use(),
                    "volume {i} says zero copy and is: {info:?}"
                );
                served.push(info);
            }
            Err(e) => {
                ensure!(
                    e.kind() == ErrorKind::ResourceExhausted,
                    "volume {i}: refused as RESOURCE_EXHAUSTED, not {e:?}"
                );
                refused += 1;
            }
        }
    }
    println!(
        "{} volumes served with zero copy, {refused} refused",
        served.len()
    );
    ensure!(served.len() == 128, "every slot used: {}", served.len());
    ensure!(
        guest::ublk_char_devices()?.len() == 128,
        "refused volumes leave no device"
    );
    // A sample verifies its data while all are open.
    let sample: Vec<_> = served.iter().step_by(31).collect();
    let mut runs = Vec::new();
    for info in &sample {
        runs.push(
            std::process::Command::new("fio")
                .args([
                    "--name=v",
                    &format!("--filename={}", info.block_device.display()),
                    "--ioengine=io_uring",
                    "--direct=1",
                    "--rw=randwrite",
                    "--bsrange=4k-256k",
                    "--iodepth=16",
                    "--size=100%",
                    "--verify=crc32c",
                    "--do_verify=1",
                    "--verify_fatal=1",
                ])
                .output(),
        );
    }
    for (info, run) in sample.iter().zip(runs) {
        let out = run?;
        ensure!(
            out.status.success(),
            "fio verify on {}: {}",
            info.block_device.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for info in &served {
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    assert_clean()
}

#[test]
fn nvme_path_errors_are_retried_with_a_bound() -> Result<()> {
    let ns = PathBuf::from("/dev/ng0n1");
    let dp = guest::dataplane()?;
    for (zc, poll) in [(Toggle::On, Toggle::On), (Toggle::Off, Toggle::Off)] {
        let info = dp.add_device(ublkd_dataplane::DeviceSpec {
            zero_copy: zc,
            poll,
            ..guest::spec(
                BackendSpec::Nvme {
                    path: ns.clone(),
                    window: Some(ublkd_dataplane::Window {
                        offset: 0,
                        len: 32 * MIB,
                    }),
                    keep_data: false,
                },
                32 * MIB,
                IoPath::Batch,
            )
        })?;
        // 40 path errors (a controller reset, say) under fio verify: each is resent after a
        // back-off, no request fails, nothing is lost.
        hooks::arm(Fault::NvmePathError, 40);
        guest::fio(
            &info.block_device,
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=8",
                "--size=100%",
                "--io_size=8m",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
            ],
        )?;
        let fired_all = !hooks::fire(Fault::NvmePathError);
        let stats = dp.stats(info.dev_id)?;
        println!(
            "zero copy {zc:?}, poll {poll:?}: {} retries, {} errors",
            stats.total.retries, stats.total.errors
        );
        ensure!(fired_all, "all 40 path errors were injected");
        ensure!(stats.total.retries == 40, "{stats:?}");
        ensure!(stats.total.errors == 0, "{stats:?}");
        // A path that stays down: after 5 resends the request fails (EIO), once.
        hooks::arm(Fault::NvmePathDown, 6);
        let dd = guest::sh(&format!(
            "dd if={} of=/dev/null bs=4k count=1 iflag=direct status=none",
            info.block_device.display()
        ));
        hooks::arm(Fault::NvmePathDown, 0);
        let after = dp.stats(info.dev_id)?;
        ensure!(dd.is_err(), "a request failing 6 times in a row fails");
        ensure!(
            after.total.retries == 45 && after.total.errors == 1,
            "5 more resends, then one error: {after:?}"
        );
        dp.delete_device(info.dev_id)?;
    }
    dp.shutdown()?;
    assert_clean()
}
