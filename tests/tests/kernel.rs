//! The guest kernel offers what ublkd is built on: the ublk driver with BATCH_IO and
//! AUTO_BUF_REG, an NVMe controller with poll queues, and the tools the other tests drive.
#![cfg(feature = "vm")]

use anyhow::Result;
use std::path::Path;
use ublkd_dataplane::{ControlDevice, Features};
use ublkd_tests::{fio_errors, fio_json, fio_total_bytes, in_vm, read_trimmed};

#[test]
fn ublk_drv_is_loaded_and_control_device_exists() -> Result<()> {
    assert!(in_vm(), "VM tests run inside the harness's guest");
    assert!(
        Path::new("/sys/module/ublk_drv").is_dir(),
        "ublk_drv is not loaded"
    );
    let meta = std::fs::metadata("/dev/ublk-control")?;
    use std::os::unix::fs::FileTypeExt;
    assert!(
        meta.file_type().is_char_device(),
        "/dev/ublk-control is not a char device"
    );
    Ok(())
}

#[test]
fn get_features_reports_batch_io_and_auto_buf_reg() -> Result<()> {
    let mut ctrl = ControlDevice::open()?;
    let features = ctrl.features()?;
    println!("ublk features {:#x}: {features}", features.0);
    assert!(
        features.contains(Features::BATCH_IO),
        "no BATCH_IO in {features}"
    );
    assert!(
        features.contains(Features::AUTO_BUF_REG),
        "no AUTO_BUF_REG in {features}"
    );
    // Flags older than both must be there too; a mask of garbage would not have them in order.
    assert!(features.contains(Features::USER_RECOVERY | Features::UPDATE_SIZE));
    Ok(())
}

#[test]
fn nvme_namespace_has_char_device_and_poll_queues() -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let ng = std::fs::metadata("/dev/ng0n1")?;
    assert!(
        ng.file_type().is_char_device(),
        "/dev/ng0n1 is not a char device"
    );
    assert!(std::fs::metadata("/dev/nvme0n1")?
        .file_type()
        .is_block_device());
    let poll_queues: u32 = read_trimmed("/sys/module/nvme/parameters/poll_queues")?.parse()?;
    assert!(
        poll_queues >= 1,
        "nvme.poll_queues={poll_queues}: the parameter did not reach the module"
    );
    // io_poll is 1 only when the controller really set up poll queues.
    assert_eq!(read_trimmed("/sys/block/nvme0n1/queue/io_poll")?, "1");
    Ok(())
}

#[test]
fn fio_verifies_data_on_the_nvme_namespace() -> Result<()> {
    let report = fio_json(&[
        "--name=smoke",
        "--filename=/dev/nvme0n1",
        "--ioengine=io_uring",
        "--direct=1",
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--iodepth=8",
        "--verify=crc32c",
        "--do_verify=1",
    ])?;
    assert_eq!(fio_errors(&report), 0);
    // 16 MiB written, then read back for verification.
    assert!(
        fio_total_bytes(&report) >= 32 << 20,
        "fio moved too little data: {report}"
    );
    Ok(())
}
