//! Fault paths, each forced (dataplane test hooks, `test-hooks` feature): a failure may cost a
//! request or a volume its service, never a device, a leaked kernel device, a hung task or the
//! daemon.
#![cfg(feature = "vm")]

use anyhow::{ensure, Result};
use std::time::{Duration, Instant};
use ublkd_dataplane::hooks::{self, Fault};
use ublkd_dataplane::{BackendSpec, IoPath};
use ublkd_proto::v1;
use ublkd_tests::daemon::{sample, Daemon};
use ublkd_tests::guest;

const MIB: u64 = 1 << 20;

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
        size_bytes: size,
        backend: Some(backend),
        queues: Some(1),
        queue_depth: Some(depth),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ram_volume_memory_is_measured_in_constant_time() -> Result<()> {
    use v1::volume_spec::Backend;
    let dir = guest::scratch("rammem")?;
    let mut d = Daemon::new(&dir, 19601, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let ram = || Backend::Ram(v1::RamBackend {});
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
    // 200 volumes of every backend: scrapes stay cheap and RSS does not grow with them.
    for i in 0..198u32 {
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
            sample(&text, "ublkd_volumes", &[]) == Some(200.0),
            "200 volumes"
        );
    }
    let rss_after = rss_kib(pid);
    println!(
        "200 volumes: slowest of 5 scrapes {:.1} ms; RSS {rss_before} KiB -> {rss_after} KiB",
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
