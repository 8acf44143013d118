//! Per-volume QoS in the guest: limits measured by fio against real ublk devices, a neighbour
//! that keeps its pace, live changes, and limits that survive kill -9. Every check is a ratio
//! computed from fio's own report, never a timing threshold on the machine.
#![cfg(feature = "vm")]

use anyhow::{ensure, Context, Result};
use std::path::Path;
use ublkd_proto::v1;
use ublkd_tests::api::{self, create, volume as spec};
use ublkd_tests::daemon::{sample, Daemon};
use ublkd_tests::guest;
use ublkd_tests::MIB;

/// fio at QD32 on `dev` for `secs` seconds after one second of ramp (which the burst allowance
/// falls into); returns (read IOPS, write bytes per second).
fn measure(dev: &str, rw: &str, bs: &str, secs: u32) -> Result<(f64, f64)> {
    let runtime = format!("--runtime={secs}");
    let bs = format!("--bs={bs}");
    let rw = format!("--rw={rw}");
    let r = guest::fio(
        Path::new(dev),
        &[
            &rw,
            &bs,
            "--iodepth=32",
            "--time_based",
            "--ramp_time=1",
            &runtime,
        ],
    )?;
    let job = &r["jobs"][0];
    let iops = job["read"]["iops"].as_f64().context("read iops")?;
    let wbw = job["write"]["bw_bytes"].as_f64().context("write bw")?;
    Ok((iops, wbw))
}

fn limits(read_iops: u64, write_bw: u64) -> v1::QosLimits {
    v1::QosLimits {
        read_iops,
        write_bytes_per_second: write_bw,
        ..Default::default()
    }
}

/// A quarter of `pace`, rounded down to a multiple of `unit` and at least one unit.
fn quarter(pace: f64, unit: f64) -> u64 {
    // Saturating float-to-int: a pace is finite and far below u64::MAX.
    ((pace / 4.0 / unit).floor().max(1.0) * unit) as u64
}

fn within(measured: f64, limit: f64, what: &str) -> Result<()> {
    let ratio = measured / limit;
    println!("{what}: limit {limit:.0}, measured {measured:.0}, ratio {ratio:.3}");
    ensure!(
        (0.9..=1.1).contains(&ratio),
        "{what}: measured {measured:.0} against a limit of {limit:.0} (ratio {ratio:.3})"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_neighbours_keep_pace_changes_are_live_and_survive_kill_9() -> Result<()> {
    let dir = guest::scratch("qos")?;
    let mut d = Daemon::new(&dir, 19611, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    // Two queues each, one per CPU: both volumes' queues share the two workers.
    let mut free_spec = spec(256 * MIB, api::ram());
    free_spec.queues = Some(2);
    let free = c
        .create_volume(create("q-free", free_spec))
        .await?
        .into_inner();
    // The limits are a quarter of what this guest does unlimited, so that they bind on a fast
    // host and a slow one alike: a fixed 2000 IOPS is above a slow emulated guest's whole pace,
    // and then no throttle is measured at all.
    let (alone, _) = measure(&free.device_path, "randread", "4k", 3)?;
    let (_, free_wbw) = measure(&free.device_path, "randwrite", "64k", 3)?;
    let read_limit = quarter(alone, 100.0);
    let write_limit = quarter(free_wbw, MIB as f64);
    let low_limit = quarter(read_limit as f64, 25.0);
    println!(
        "unlimited here: {alone:.0} read IOPS, {free_wbw:.0} B/s written; limits {read_limit} IOPS, \
         {write_limit} B/s, then {low_limit} IOPS"
    );
    let mut lim_spec = spec(256 * MIB, api::ram());
    lim_spec.queues = Some(2);
    lim_spec.qos = Some(limits(read_limit, 0));
    let lim = c
        .create_volume(create("q-lim", lim_spec))
        .await?
        .into_inner();
    assert_eq!(
        lim.spec.as_ref().and_then(|s| s.qos).map(|q| q.read_iops),
        Some(read_limit),
        "the Volume shows its limits"
    );

    // The limited volume alone reaches its limit and no more.
    let (lim_alone, _) = measure(&lim.device_path, "randread", "4k", 3)?;
    let read_limit_f = read_limit as f64;
    within(
        lim_alone,
        read_limit_f,
        "read IOPS at QD32, a quarter of the unlimited pace",
    )?;
    // The neighbour alone, then both at once, then alone again. With both guest CPUs saturated
    // by the neighbour, how far the limited volume's own fio falls short of its limit is the
    // scheduler's doing (a run on a loaded host saw 0.81), not the throttle's; what the throttle
    // owes here is never to let it past its limit.
    // The neighbour's pace beside it is held against the slower of the runs alone around it, so
    // that a change in the host's load between runs cannot pass for the throttle's doing. Two
    // runs alone on an emulated CPU differ by up to a third (8,628 and 11,179 IOPS in one test),
    // so a round below 0.8 is measured again, up to three rounds: a throttle that takes the
    // shared workers from the neighbour fails every round, the host's noise seldom twice.
    let mut alone_before = alone;
    let mut rounds = Vec::new();
    for round in 1..=3 {
        let lim_dev = lim.device_path.clone();
        let limited = std::thread::spawn(move || measure(&lim_dev, "randread", "4k", 4));
        let (together, _) = measure(&free.device_path, "randread", "4k", 3)?;
        let (lim_iops, _) = limited.join().expect("fio thread")?;
        let lim_ratio = lim_iops / read_limit_f;
        println!(
            "round {round}: limited volume beside the neighbour: {lim_iops:.0} IOPS ({lim_ratio:.3} of its limit)"
        );
        ensure!(
            lim_ratio <= 1.1,
            "beside the neighbour the limited volume ran at {lim_ratio:.3} of its limit"
        );
        let (alone_after, _) = measure(&free.device_path, "randread", "4k", 3)?;
        let slower = alone_before.min(alone_after);
        let kept = together / slower;
        println!(
            "round {round}: neighbour alone {alone_before:.0} then {alone_after:.0} IOPS, beside the limited volume {together:.0} ({kept:.3} of the slower)"
        );
        rounds.push(kept);
        if kept >= 0.8 {
            break;
        }
        alone_before = alone_after;
    }
    ensure!(
        rounds.iter().any(|&k| k >= 0.8),
        "the unlimited neighbour fell below 0.8 of its pace alone in every round: {rounds:.3?}"
    );

    // Bandwidth, for writes in 64 KiB requests: a quarter of the unlimited pace.
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "q-lim".into(),
        qos: Some(limits(read_limit, write_limit)),
    })
    .await?;
    let (_, wbw) = measure(&lim.device_path, "randwrite", "64k", 3)?;
    within(
        wbw,
        write_limit as f64,
        "write bytes/s at QD32, a quarter of the unlimited pace",
    )?;

    // A live change while requests wait for the old limit; measured from one second on.
    let lim_dev = lim.device_path.clone();
    let busy = std::thread::spawn(move || measure(&lim_dev, "randread", "4k", 2));
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "q-lim".into(),
        qos: Some(limits(low_limit, 0)),
    })
    .await?;
    busy.join().expect("fio thread")?;
    let (after, _) = measure(&lim.device_path, "randread", "4k", 3)?;
    within(
        after,
        low_limit as f64,
        "read IOPS one second after a live change to a quarter of the limit",
    )?;

    // Limits survive kill -9: the restarted daemon takes the device over with them.
    d.stop_with(libc::SIGKILL)?;
    d.start().await?;
    d.wait_all_ready().await?;
    let mut c = d.volumes().await?;
    let back = c
        .get_volume(v1::GetVolumeRequest { id: "q-lim".into() })
        .await?
        .into_inner();
    assert_eq!(
        back.spec.and_then(|s| s.qos).map(|q| q.read_iops),
        Some(low_limit)
    );
    let (recovered, _) = measure(&lim.device_path, "randread", "4k", 3)?;
    within(
        recovered,
        low_limit as f64,
        "read IOPS after kill -9 and takeover, the lowered limit",
    )?;

    // What was throttled is counted for the limited volume only.
    let text = d.scrape()?;
    let throttled = |v: &str| {
        sample(
            &text,
            "ublkd_volume_throttled_requests_total",
            &[("volume", v)],
        )
        .unwrap_or(0.0)
    };
    ensure!(
        throttled("q-lim") > 0.0,
        "no throttled requests counted:\n{text}"
    );
    assert_eq!(
        throttled("q-free"),
        0.0,
        "the unlimited volume was never held"
    );
    let stats = c
        .get_volume_stats(v1::GetVolumeStatsRequest { id: "q-lim".into() })
        .await?
        .into_inner();
    ensure!(
        stats.throttled_requests > 0 && stats.throttled_seconds > 0.0,
        "{stats:?}"
    );

    // Cleared: back to the unlimited pace.
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "q-lim".into(),
        qos: None,
    })
    .await?;
    let (cleared, _) = measure(&lim.device_path, "randread", "4k", 3)?;
    println!("cleared: {cleared:.0} IOPS (unlimited neighbour alone: {alone:.0})");
    ensure!(
        cleared > 2.0 * low_limit as f64,
        "limits cleared, yet {cleared:.0} IOPS (the limit was {low_limit})"
    );
    for id in ["q-lim", "q-free"] {
        c.delete_volume(v1::DeleteVolumeRequest {
            id: id.into(),
            ..Default::default()
        })
        .await?;
    }
    let st = d.stop_with(libc::SIGTERM)?;
    assert!(st.success(), "clean exit: {st}\n{}", d.log());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttle_timer_that_cannot_be_queued_serves_requests_over_the_limit_never_stuck(
) -> Result<()> {
    let dir = guest::scratch("qos-timer")?;
    let mut d = Daemon::new(&dir, 19613, "")?;
    // The first five throttle timers cannot be queued.
    d.env = vec![("UBLKD_TEST_FAULTS".into(), "throttle_timer=5".into())];
    d.start().await?;
    let mut c = d.volumes().await?;
    let mut s = spec(64 * MIB, api::ram());
    s.qos = Some(limits(200, 0));
    let v = c.create_volume(create("q-t", s)).await?.into_inner();
    // A fixed number of reads: each one finishes, whether timed or served over the limit.
    guest::fio(
        Path::new(&v.device_path),
        &[
            "--rw=randread",
            "--bs=4k",
            "--iodepth=32",
            "--number_ios=400",
        ],
    )?;
    let text = d.scrape()?;
    let over = sample(
        &text,
        "ublkd_volume_throttle_overruns_total",
        &[("volume", "q-t")],
    )
    .unwrap_or(0.0);
    let held = sample(
        &text,
        "ublkd_volume_throttled_requests_total",
        &[("volume", "q-t")],
    )
    .unwrap_or(0.0);
    println!(
        "400 reads at 200 IOPS, 5 timers refused: {over} served over the limit, {held} waited"
    );
    ensure!(
        over >= 5.0,
        "each refused timer serves at least one request over the limit: {over}"
    );
    ensure!(
        held > 0.0,
        "once timers could be queued again, requests waited: {held}"
    );
    let st = d.stop_with(libc::SIGTERM)?;
    assert!(st.success(), "clean exit: {st}\n{}", d.log());
    Ok(())
}

async fn volume_stats(
    c: &mut v1::volume_service_client::VolumeServiceClient<tonic::transport::Channel>,
    id: &str,
) -> Result<v1::VolumeStats> {
    Ok(
        c.get_volume_stats(v1::GetVolumeStatsRequest { id: id.into() })
            .await?
            .into_inner(),
    )
}

/// A weekly fstrim on a throttled volume must not stall it (issue 22, item 10): discards cost
/// one small I/O, as blk-throttle charges them, so at a 1 MiB/s write limit trimming a file
/// system's free space is never held by the limit, and a write after it is not either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fstrim_on_a_throttled_volume_is_not_held_by_its_write_limit() -> Result<()> {
    let dir = guest::scratch("qos-trim")?;
    let mut d = Daemon::new(&dir, 19618, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let backing = d.root.join("trim.img");
    let vol = c
        .create_volume(create("q-trim", spec(128 * MIB, api::file(&backing, true))))
        .await?
        .into_inner();
    let dev = vol.device_path.clone();
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    guest::sh(&format!("mkfs.ext4 -q -E nodiscard {dev}"))?;
    guest::sh(&format!("mount {dev} {}", mnt.display()))?;
    // Data written and deleted, so the trim has extents to give back.
    guest::sh(&format!(
        "dd if=/dev/urandom of={m}/fill bs=1M count=32 conv=fsync status=none && rm {m}/fill && sync",
        m = mnt.display()
    ))?;
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "q-trim".into(),
        qos: Some(limits(0, MIB)),
    })
    .await?;
    let held = |s: &v1::VolumeStats| s.throttled_requests;
    let before = volume_stats(&mut c, "q-trim").await?;
    // Bounded so a stalled trim fails this test instead of the suite's per-test timeout.
    let out = guest::sh(&format!("timeout 120 fstrim -v {}", mnt.display()))?;
    println!("fstrim: {}", out.trim());
    let after = volume_stats(&mut c, "q-trim").await?;
    let discards = |s: &v1::VolumeStats| {
        s.ops
            .iter()
            .find(|o| o.op == "discard")
            .map_or(0, |o| o.count)
    };
    println!(
        "discards {} -> {}, throttled requests {} -> {}",
        discards(&before),
        discards(&after),
        held(&before),
        held(&after)
    );
    ensure!(
        discards(&after) > discards(&before),
        "fstrim sent no discard to the volume: {after:?}"
    );
    ensure!(
        held(&after) == held(&before),
        "the throttle held {} request(s) of the trim",
        held(&after) - held(&before)
    );
    // The trim put the volume in no debt: a small write right after it is not held either
    // (charged by length, 100 MiB of discards would hold it for 100 s at 1 MiB/s).
    guest::sh(&format!(
        "timeout 60 dd if=/dev/zero of={m}/after bs=4k count=1 oflag=direct,sync status=none",
        m = mnt.display()
    ))
    .context("a write after the trim")?;
    let written = volume_stats(&mut c, "q-trim").await?;
    println!("throttled requests after a write: {}", held(&written));
    ensure!(
        held(&written) == held(&before),
        "the write after the trim waited for the limit: the trim left the volume in debt"
    );
    guest::sh(&format!("umount {}", mnt.display()))?;
    c.delete_volume(v1::DeleteVolumeRequest {
        id: "q-trim".into(),
        delete_backing: true,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// A volume in QoS debt can be deleted (issue 22, item 8): 128 writes of 1 MiB wait for a
/// 1 MiB/s limit, two minutes of tokens, longer than the control timeout. The delete lets them
/// go before STOP_DEV, and a second try (at worst) finds the device gone and finishes: nothing
/// of the volume is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_deep_in_qos_debt_is_deleted_and_nothing_is_left() -> Result<()> {
    let dir = guest::scratch("qos-debt")?;
    let mut d = Daemon::new(&dir, 19620, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let mut s = spec(512 * MIB, api::ram());
    s.queue_depth = Some(128);
    s.qos = Some(limits(0, MIB));
    let vol = c.create_volume(create("q-debt", s)).await?.into_inner();
    let dev = vol.device_path.clone();
    let mut fio = std::process::Command::new("fio")
        .args([
            "--name=debt",
            &format!("--filename={dev}"),
            "--rw=write",
            "--bs=1M",
            "--iodepth=128",
            "--ioengine=io_uring",
            "--direct=1",
            "--time_based",
            "--runtime=300",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    // Until requests wait for tokens.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let st = volume_stats(&mut c, "q-debt").await?;
        if st.inflight >= 64 {
            println!("in flight before the delete: {}", st.inflight);
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "fio never filled the queue: {st:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // fio holds the device open (without O_EXCL): a delete is refused unless forced.
    let delete = || v1::DeleteVolumeRequest {
        id: "q-debt".into(),
        force: true,
        ..Default::default()
    };
    let first = c.delete_volume(delete()).await;
    println!("first delete: {first:?}");
    if first.is_err() {
        c.delete_volume(delete())
            .await
            .context("the second delete of a volume in QoS debt")?;
    }
    let _ = fio.kill(); // fio's writes fail once the device is gone; it may have exited.
    let _ = fio.wait(); // Reaped either way.
    let listed = c
        .list_volumes(v1::ListVolumesRequest {})
        .await?
        .into_inner();
    ensure!(
        listed.volumes.iter().all(|v| v.id != "q-debt"),
        "the volume is still listed: {listed:?}"
    );
    guest::wait_gone(
        std::path::Path::new(&dev),
        std::time::Duration::from_secs(10),
    )?;
    let orphans = d.orphans().await?;
    ensure!(orphans.is_empty(), "devices left: {orphans:?}");
    Ok(())
}

/// A write-zeroes that the backend writes through (NVMe Write Zeroes, sent without DEAC) pays
/// its length to the write limit, as blk-throttle charges it (issue 38, defect 10): charged one
/// sector like a discard, `blkdiscard -z` wrote past the limit unthrottled. Counted by the
/// volume's throttled requests, not timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_zeroes_written_through_pay_their_length_to_the_write_limit() -> Result<()> {
    let dir = guest::scratch("qos-zeroes")?;
    let mut d = Daemon::new(&dir, 19633, "")?;
    d.start().await?;
    let mut c = d.volumes().await?;
    let ns: u64 = std::fs::read_to_string("/sys/block/nvme0n1/size")?
        .trim()
        .parse::<u64>()?
        * 512;
    let len = 16 * MIB;
    let vol = c
        .create_volume(create(
            "q-zeroes",
            spec(len, api::nvme("/dev/ng0n1", ns - 64 * MIB, len)),
        ))
        .await?
        .into_inner();
    c.set_volume_qos(v1::SetVolumeQosRequest {
        id: "q-zeroes".into(),
        qos: Some(limits(0, MIB)),
    })
    .await?;
    let before = volume_stats(&mut c, "q-zeroes").await?;
    let started = std::time::Instant::now();
    guest::sh(&format!(
        "timeout 120 blkdiscard -z -l {} {}",
        8 * MIB,
        vol.device_path
    ))?;
    // One request of 8 MiB passes on credit; what it cost shows in what comes after it: a
    // 4 KiB write waits out the debt (about 7 s at 1 MiB/s), where a discard's sector would not
    // hold it.
    guest::sh(&format!(
        "timeout 120 dd if=/dev/zero of={} bs=4k count=1 oflag=direct status=none",
        vol.device_path
    ))?;
    let took = started.elapsed().as_secs_f64();
    let after = volume_stats(&mut c, "q-zeroes").await?;
    let zeroes = |s: &v1::VolumeStats| {
        s.ops
            .iter()
            .find(|o| o.op == "write_zeroes")
            .map_or(0, |o| o.count)
    };
    println!(
        "blkdiscard -z of 8 MiB, then a 4 KiB write, at 1 MiB/s: {took:.1} s, write-zeroes {} -> {}, throttled {} -> {}",
        zeroes(&before),
        zeroes(&after),
        before.throttled_requests,
        after.throttled_requests
    );
    ensure!(
        zeroes(&after) > zeroes(&before),
        "no write-zeroes reached the volume: {after:?}"
    );
    ensure!(
        after.throttled_requests > before.throttled_requests,
        "8 MiB of write-zeroes at a 1 MiB/s limit left no debt: the write after them was not held"
    );
    c.delete_volume(v1::DeleteVolumeRequest {
        id: "q-zeroes".into(),
        ..Default::default()
    })
    .await?;
    d.stop_with(libc::SIGTERM)?;
    Ok(())
}
