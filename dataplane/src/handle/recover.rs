//! Taking over a device a previous ublkd left (START/END_USER_RECOVERY), resumable when an
//! attempt fails part way. Functions of the control thread's `Control`, named at each call
//! (`recover::recover`).

use super::control::{Control, Device};
use super::lifecycle;
use super::{block_device, char_device, max_queues, DataplaneError, DeviceInfo, KernelState};
use crate::backend::{self, Growth};
use crate::ctrl::CtrlError;
use crate::device::{DeviceSpec, IoPath, KernelShape};
use crate::hooks::{self, Fault};
use crate::ids::DevId;
use crate::placement;
use crate::sys::{self, os};
use std::time::{Duration, Instant};

/// Waits until the device's previous server has let go (the kernel releases its queues
/// asynchronously after the process dies); returns the device's info.
pub(super) fn wait_released(
    control: &mut Control,
    dev_id: DevId,
) -> Result<sys::ublksrv_ctrl_dev_info, DataplaneError> {
    let deadline = Instant::now() + control.timeout;
    loop {
        let info = match control.ctrl.dev_info(dev_id) {
            Ok(i) => i,
            Err(CtrlError::Command { source, .. })
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                return Err(DataplaneError::NoSuchDevice(dev_id))
            }
            Err(e) => return Err(e.into()),
        };
        match KernelState::from_raw(info.state) {
            KernelState::Quiesced | KernelState::FailIo => return Ok(info),
            KernelState::Dead => {
                return Err(DataplaneError::NotRecoverable {
                    dev_id,
                    why: "it was stopped".into(),
                })
            }
            KernelState::Live | KernelState::Unknown(_) => {
                let pid = info.ublksrv_pid;
                if pid > 0 && pid as u32 != std::process::id() && os::pid_alive(pid) {
                    return Err(DataplaneError::Busy { dev_id, pid });
                }
                if Instant::now() >= deadline {
                    return Err(DataplaneError::ReleaseTimeout(dev_id));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

pub(super) fn recover(
    control: &mut Control,
    spec: DeviceSpec,
) -> Result<DeviceInfo, DataplaneError> {
    let dev_id = spec.dev_id.ok_or(DataplaneError::NotRecoverable {
        dev_id: DevId(u32::MAX),
        why: "no device id given".into(),
    })?;
    if control.devices.contains_key(&dev_id) {
        return Err(DataplaneError::AlreadyOwned(dev_id));
    }
    if let Some(device) = control.recovering.remove(&dev_id) {
        // A takeover that failed half way: the device is still ours and quiesced.
        let kernel_size = device.info.spec.size_bytes;
        return finish_recovery(control, device, kernel_size, spec.size_bytes);
    }
    spec.validate(max_queues())?;
    let info = wait_released(control, dev_id)?;
    let params = control.ctrl.params(dev_id)?;
    if let Some(why) = spec.takeover_mismatch(&KernelShape::of(&info, &params)) {
        return Err(DataplaneError::NotRecoverable { dev_id, why });
    }
    if let Some(name) = unservable_flags(info.flags) {
        return Err(DataplaneError::NotRecoverable {
            dev_id,
            why: format!("the device uses {name}, which ublkd does not serve"),
        });
    }
    let path = if info.flags & sys::UBLK_F_BATCH_IO != 0 {
        IoPath::Batch
    } else {
        IoPath::PerIo
    };
    let kernel_size = params.basic.dev_sectors * 512;
    let backend = backend::open(
        &spec.backend,
        spec.size_bytes.max(kernel_size),
        spec.block_size,
    )?;
    lifecycle::check_claim(control, backend.as_ref(), Some(dev_id))?;
    let kernel_zc = info.flags & sys::UBLK_F_AUTO_BUF_REG != 0;
    let (zero_copy, polled, poll_reason) =
        lifecycle::modes(control, &spec, backend.as_ref(), Some(kernel_zc))?;
    let (placement, placement_reason) =
        placement::decide(control.placement, control.dedicated_cpus);
    // A zero-copy device whose new backend must copy (an orphan adopted as a RAM volume):
    // every request takes the fallback, served by copy, which needs USER_COPY.
    let copy_only = zero_copy && !backend.zero_copy();
    if copy_only && info.flags & sys::UBLK_F_USER_COPY == 0 {
        return Err(DataplaneError::NotRecoverable {
            dev_id,
            why: "the device is zero copy without USER_COPY, and this backend copies".into(),
        });
    }
    let device = Device::new(
        DeviceInfo {
            dev_id,
            spec: DeviceSpec {
                max_io_bytes: info.max_io_buf_bytes,
                // Never shrink a device on takeover; a larger recorded size is applied below.
                size_bytes: kernel_size,
                ..spec.clone()
            },
            io_path: path,
            flags: info.flags,
            zero_copy,
            polled,
            poll_reason,
            copy_queues: 0,
            every_request_by_copy: copy_only,
            placement,
            placement_reason,
            queue_cpus: Vec::new(),
            erased: None,
            block_device: block_device(dev_id),
            char_device: char_device(dev_id),
        },
        backend,
    );
    start_recovery(control, dev_id)?;
    finish_recovery(control, device, kernel_size, spec.size_bytes)
}

/// START_USER_RECOVERY, retrying -EBUSY with a bounded back-off: the driver marks the
/// device QUIESCED before it clears its open bit, so a device found released can still be
/// busy for a moment.
pub(super) fn start_recovery(control: &mut Control, dev_id: DevId) -> Result<(), DataplaneError> {
    let deadline = Instant::now() + control.timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        let r = if hooks::fire(Fault::RecoverBusy) {
            Err(CtrlError::Command {
                command: "START_USER_RECOVERY",
                source: std::io::Error::from_raw_os_error(libc::EBUSY),
            })
        } else {
            control.ctrl.start_recovery(dev_id)
        };
        match r {
            Err(CtrlError::Command { ref source, .. })
                if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
            {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return Ok(other?),
        }
    }
}

/// Attaches the queues not attached yet and ends the recovery. On failure nothing is torn
/// down: the device stays quiesced in the kernel (applications wait, mounts and open files
/// stay) and is kept for the next `recover` of its id, which resumes here.
pub(super) fn finish_recovery(
    control: &mut Control,
    mut device: Device,
    kernel_size: u64,
    wanted_size: u64,
) -> Result<DeviceInfo, DataplaneError> {
    let dev_id = device.info.dev_id;
    if device.stuck {
        control.recovering.insert(dev_id, device);
        return Err(DataplaneError::RecoveryStuck(dev_id));
    }
    let r = lifecycle::attach_queues(control, &mut device, true)
        .and_then(|()| Ok(control.ctrl.end_recovery(dev_id)?));
    if let Err(e) = r {
        control.recovering.insert(dev_id, device);
        return Err(e);
    }
    if wanted_size > kernel_size {
        // A grow recorded but not (or not wholly) applied before a crash. The device serves
        // either way: if growing fails it keeps its size, which its info reports.
        let grown = device
            .backend
            .resize(wanted_size, Growth::Erase)
            .map_err(DataplaneError::from)
            .and_then(|()| Ok(control.ctrl.update_size(dev_id, wanted_size / 512)?));
        if grown.is_ok() {
            device.info.spec.size_bytes = wanted_size;
        }
    }
    let out = device.info.clone();
    control.devices.insert(dev_id, device);
    Ok(out)
}

/// The data path a device's flags ask for that this server does not speak, if any: serving such
/// a device could only corrupt its data.
fn unservable_flags(flags: u64) -> Option<&'static str> {
    let foreign = [
        (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
        (sys::UBLK_F_ZONED, "ZONED"),
        (sys::UBLK_F_INTEGRITY, "INTEGRITY"),
        (sys::UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
        (sys::UBLK_F_IO_DESC_SIZE, "IO_DESC_SIZE"),
    ];
    let zc_only = sys::UBLK_F_USER_COPY | sys::UBLK_F_SUPPORT_ZERO_COPY;
    foreign
        .iter()
        .find(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| *name)
        .or_else(|| {
            (flags & zc_only != 0 && flags & sys::UBLK_F_AUTO_BUF_REG == 0)
                .then_some("USER_COPY or SUPPORT_ZERO_COPY without AUTO_BUF_REG")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_refuses_data_paths_ublkd_does_not_speak() {
        let ours = sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_BATCH_IO | sys::UBLK_F_AUTO_BUF_REG;
        assert_eq!(unservable_flags(ours), None);
        assert_eq!(unservable_flags(ours | sys::UBLK_F_USER_COPY), None);
        for (bit, name) in [
            (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
            (sys::UBLK_F_ZONED, "ZONED"),
            (sys::UBLK_F_INTEGRITY, "INTEGRITY"),
            (sys::UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
            (sys::UBLK_F_IO_DESC_SIZE, "IO_DESC_SIZE"),
        ] {
            assert_eq!(unservable_flags(ours | bit), Some(name));
        }
        assert!(unservable_flags(sys::UBLK_F_USER_COPY).is_some());
    }
}
