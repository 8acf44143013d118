//! NVMe volumes on a native-multipath subsystem: the guest boots with a second NVMe subsystem
//! (`nqn…ublkd-mpath`) of two controllers (`Vm::multipath`), so its char devices are the
//! multipath heads' (`ngSnH`, named by subsystem and head instance, not by namespace id) and
//! their sysfs parent is the subsystem, not a controller. The harness runs this file in a boot of
//! its own: with three controllers probed asynchronously, even the first one's name is not fixed.
//! Namespace 1 has 4 KiB blocks and is attached to one controller; namespace 2 (512 B) to both.
#![cfg(feature = "vm")]

use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use ublkd_dataplane::{BackendSpec, DeviceSpec, Toggle};
use ublkd_tests::guest;

const SUBSYS_NQN_SUFFIX: &str = "ublkd-mpath";

/// A multipath head of the test subsystem: its char device and its block device's sysfs.
struct Head {
    char_dev: PathBuf,
    disk: PathBuf,
    nsid: u64,
}

fn read(path: &Path) -> Result<String> {
    ublkd_tests::read_trimmed(path).with_context(|| path.display().to_string())
}

/// The heads of the test subsystem, found the way an operator would: the generic char devices
/// whose parent is that subsystem, and the disk there with the same namespace id.
fn heads() -> Result<Vec<Head>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/class/nvme-generic")?.flatten() {
        let parent = std::fs::canonicalize(e.path().join("device"))?;
        let Ok(nqn) = read(&parent.join("subsysnqn")) else {
            continue; // a controller's char device (no multipath): not ours
        };
        if !nqn.ends_with(SUBSYS_NQN_SUFFIX) {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        // A head's disk and char device are both named by subsystem and head instance
        // (`nvmeSnH`, `ngSnH`) and both sit in the subsystem's directory.
        let (_, instances) = name.split_once("ng").context("ng name")?;
        let disk = parent.join(format!("nvme{instances}"));
        let nsid = read(&disk.join("nsid"))?.parse()?;
        out.push(Head {
            char_dev: PathBuf::from("/dev").join(&name),
            disk,
            nsid,
        });
    }
    out.sort_by_key(|h| h.nsid);
    Ok(out)
}

fn queue_attr(disk: &Path, attr: &str) -> Result<u64> {
    Ok(read(&disk.join("queue").join(attr))?.parse()?)
}

/// Each multipath head serves a volume with the namespace's own limits (block size, largest
/// I/O, polling) and passes fio verify on both I/O paths.
#[test]
fn multipath_heads_get_their_namespace_limits() -> Result<()> {
    let heads = heads()?;
    ensure!(
        heads.iter().map(|h| h.nsid).collect::<Vec<_>>() == [1, 2],
        "the harness's multipath subsystem has namespaces 1 and 2: {:?}",
        heads.iter().map(|h| &h.char_dev).collect::<Vec<_>>()
    );
    // CPUs declared dedicated, so that `poll = auto` polls wherever the namespace can.
    let dp = ublkd_dataplane::Handle::start(ublkd_dataplane::Config {
        cpus: vec![0, 1],
        dedicated_cpus: true,
        ..Default::default()
    })?;
    for head in &heads {
        let lbs = queue_attr(&head.disk, "logical_block_size")?;
        let max_kb = queue_attr(&head.disk, "max_hw_sectors_kb")?;
        let io_poll = queue_attr(&head.disk, "io_poll")? == 1;
        let bytes = read(&head.disk.join("size"))?.parse::<u64>()? * 512;
        println!(
            "{} nsid {}: {} B blocks, {} KiB max I/O, io_poll {io_poll}, {bytes} B",
            head.char_dev.display(),
            head.nsid,
            lbs,
            max_kb
        );
        for path in guest::PATHS {
            let info = dp.add_device(DeviceSpec {
                block_size: lbs as u32,
                poll: Toggle::Auto,
                ..guest::spec(
                    BackendSpec::Nvme {
                        path: head.char_dev.clone(),
                        window: None,
                        keep_data: false,
                    },
                    bytes,
                    path,
                )
            })?;
            let ours = PathBuf::from(format!("/sys/block/ublkb{}", info.dev_id));
            ensure!(queue_attr(&ours, "logical_block_size")? == lbs);
            ensure!(
                queue_attr(&ours, "max_hw_sectors_kb")? <= max_kb,
                "passthrough is never split: our max I/O is the namespace's at most"
            );
            ensure!(
                info.polled == io_poll,
                "polled {} but the namespace's io_poll is {io_poll}: limits read from the \
                 wrong sysfs node",
                info.polled
            );
            guest::fio(
                &info.block_device,
                &[
                    "--rw=randwrite",
                    "--bsrange=4k-256k",
                    "--iodepth=16",
                    "--size=100%",
                    "--io_size=16m",
                    "--verify=crc32c",
                    "--do_verify=1",
                    "--verify_fatal=1",
                ],
            )?;
            let stats = dp.stats(info.dev_id)?;
            ensure!(stats.total.errors == 0, "no errors: {stats:?}");
            dp.delete_device(info.dev_id)?;
        }
    }
    ensure!(
        heads
            .iter()
            .any(|h| queue_attr(&h.disk, "io_poll").ok() == Some(1)),
        "the subsystem's controllers have poll queues (nvme.poll_queues), so the polling check \
         above tested something"
    );
    dp.shutdown()?;
    Ok(())
}
