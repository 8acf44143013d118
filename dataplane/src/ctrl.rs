//! The ublk control device, `/dev/ublk-control`: feature probe and device lifecycle commands.
//!
//! Commands run on a [`ControlRing`] of their own, never on a worker's ring, each bounded by a
//! timeout.

use crate::features::Features;
use crate::ids::{DevId, QueueId};
use crate::ring::{ControlRing, KernelBuf, RingError};
use crate::sys;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default path of the control device.
pub const CONTROL_PATH: &str = "/dev/ublk-control";
/// Default bound on one control command.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the control device, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum CtrlError {
    #[error("cannot open {path} (is the ublk_drv module loaded?)")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("control ring")]
    Ring(#[from] RingError),
    #[error("{command} failed")]
    Command {
        command: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{command} did not complete within {after:?}")]
    Timeout {
        command: &'static str,
        after: Duration,
    },
    #[error("{command} returned {got} bytes, expected {want}")]
    ShortReply {
        command: &'static str,
        got: usize,
        want: usize,
    },
}

/// The CPU numbers set in a cpumask (bit `n` of byte `n / 8` is CPU `n`).
fn cpus_of_mask(mask: &[u8]) -> Vec<usize> {
    (0..mask.len() * 8)
        .filter(|&cpu| mask[cpu / 8] & (1 << (cpu % 8)) != 0)
        .collect()
}

/// An open `/dev/ublk-control` with its own small SQE128 ring.
#[derive(Debug)]
pub struct ControlDevice {
    file: File,
    ring: ControlRing,
    timeout: Duration,
}

impl ControlDevice {
    /// Opens the default control device.
    pub fn open() -> Result<Self, CtrlError> {
        Self::open_path(Path::new(CONTROL_PATH))
    }

    /// Opens the control device at `path`.
    pub fn open_path(path: &Path) -> Result<Self, CtrlError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| CtrlError::Open {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            file,
            ring: ControlRing::new(32)?,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Sets the bound on each control command.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs one control command; a negative result becomes `CtrlError::Command`.
    fn exec(
        &mut self,
        command: &'static str,
        op: u32,
        dev_id: DevId,
        data0: u64,
        buf: Option<KernelBuf>,
    ) -> Result<(i32, Option<KernelBuf>), CtrlError> {
        let cmd = sys::ublksrv_ctrl_cmd {
            dev_id: dev_id.0,
            queue_id: u16::MAX,
            data: [data0],
            ..Default::default()
        };
        let (res, buf) = self
            .ring
            .uring_cmd(self.file.as_raw_fd(), op, cmd, buf, self.timeout)
            .map_err(|e| match e {
                RingError::Timeout(after) => CtrlError::Timeout { command, after },
                other => CtrlError::Ring(other),
            })?;
        if res < 0 {
            return Err(CtrlError::Command {
                command,
                source: io::Error::from_raw_os_error(-res),
            });
        }
        Ok((res, buf))
    }

    /// `ADD_DEV`: asks for a device described by `info` (dev_id `u32::MAX` lets the kernel pick);
    /// returns the kernel's answer (dev id, granted flags, ...).
    pub fn add_dev(
        &mut self,
        info: &sys::ublksrv_ctrl_dev_info,
    ) -> Result<sys::ublksrv_ctrl_dev_info, CtrlError> {
        let (_, buf) = self.exec(
            "ADD_DEV",
            sys::UBLK_U_CMD_ADD_DEV,
            DevId(info.dev_id),
            0,
            Some(sys::to_bytes(info)),
        )?;
        buf.as_deref()
            .and_then(sys::from_bytes)
            .ok_or(CtrlError::ShortReply {
                command: "ADD_DEV",
                got: 0,
                want: size_of::<sys::ublksrv_ctrl_dev_info>(),
            })
    }

    /// `GET_DEV_INFO`: the kernel's view of device `dev_id`.
    pub fn dev_info(&mut self, dev_id: DevId) -> Result<sys::ublksrv_ctrl_dev_info, CtrlError> {
        let buf = sys::to_bytes(&sys::ublksrv_ctrl_dev_info::default());
        let (_, buf) = self.exec(
            "GET_DEV_INFO",
            sys::UBLK_U_CMD_GET_DEV_INFO,
            dev_id,
            0,
            Some(buf),
        )?;
        buf.as_deref()
            .and_then(sys::from_bytes)
            .ok_or(CtrlError::ShortReply {
                command: "GET_DEV_INFO",
                got: 0,
                want: size_of::<sys::ublksrv_ctrl_dev_info>(),
            })
    }

    /// `SET_PARAMS`.
    pub fn set_params(
        &mut self,
        dev_id: DevId,
        params: &sys::ublk_params,
    ) -> Result<(), CtrlError> {
        self.exec(
            "SET_PARAMS",
            sys::UBLK_U_CMD_SET_PARAMS,
            dev_id,
            0,
            Some(sys::to_bytes(params)),
        )
        .map(drop)
    }

    /// `START_DEV` with the server's pid; the kernel then adds `/dev/ublkbN`.
    pub fn start_dev(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        let pid = u64::from(std::process::id());
        self.exec("START_DEV", sys::UBLK_U_CMD_START_DEV, dev_id, pid, None)
            .map(drop)
    }

    /// `STOP_DEV`: removes `/dev/ublkbN`; outstanding fetches complete with ABORT.
    pub fn stop_dev(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        self.exec("STOP_DEV", sys::UBLK_U_CMD_STOP_DEV, dev_id, 0, None)
            .map(drop)
    }

    /// `DEL_DEV_ASYNC`: removes the device without waiting for its last reference to go.
    pub fn del_dev_async(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        self.exec(
            "DEL_DEV_ASYNC",
            sys::UBLK_U_CMD_DEL_DEV_ASYNC,
            dev_id,
            0,
            None,
        )
        .map(|_| ())
    }

    /// `DEL_DEV`: forgets the device; needs every fd and mapping of `/dev/ublkcN` closed.
    pub fn del_dev(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        self.exec("DEL_DEV", sys::UBLK_U_CMD_DEL_DEV, dev_id, 0, None)
            .map(drop)
    }

    /// `GET_PARAMS`: the device's parameters as the kernel holds them.
    pub fn params(&mut self, dev_id: DevId) -> Result<sys::ublk_params, CtrlError> {
        let p = sys::ublk_params {
            len: size_of::<sys::ublk_params>() as u32,
            ..Default::default()
        };
        let (_, buf) = self.exec(
            "GET_PARAMS",
            sys::UBLK_U_CMD_GET_PARAMS,
            dev_id,
            0,
            Some(sys::to_bytes(&p)),
        )?;
        buf.as_deref()
            .and_then(sys::from_bytes)
            .ok_or(CtrlError::ShortReply {
                command: "GET_PARAMS",
                got: 0,
                want: size_of::<sys::ublk_params>(),
            })
    }

    /// `GET_QUEUE_AFFINITY`: the CPUs blk-mq maps to queue `q` (those whose requests it
    /// carries), as CPU numbers.
    pub fn queue_affinity(&mut self, dev_id: DevId, q: QueueId) -> Result<Vec<usize>, CtrlError> {
        // A cpu_set_t: room for 1024 CPUs.
        let (_, buf) = self.exec(
            "GET_QUEUE_AFFINITY",
            sys::UBLK_U_CMD_GET_QUEUE_AFFINITY,
            dev_id,
            u64::from(q.0),
            Some(vec![0u8; 128].into_boxed_slice()),
        )?;
        Ok(cpus_of_mask(buf.as_deref().unwrap_or_default()))
    }

    /// `START_USER_RECOVERY`: a new server is about to take over a device whose server is gone.
    pub fn start_recovery(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        self.exec(
            "START_USER_RECOVERY",
            sys::UBLK_U_CMD_START_USER_RECOVERY,
            dev_id,
            0,
            None,
        )
        .map(drop)
    }

    /// `END_USER_RECOVERY` with this process's pid: every queue is fetched again; I/O resumes.
    pub fn end_recovery(&mut self, dev_id: DevId) -> Result<(), CtrlError> {
        let pid = u64::from(std::process::id());
        self.exec(
            "END_USER_RECOVERY",
            sys::UBLK_U_CMD_END_USER_RECOVERY,
            dev_id,
            pid,
            None,
        )
        .map(drop)
    }

    /// `QUIESCE_DEV`: stop taking new requests, wait (up to `timeout_ms`) for those in flight,
    /// then abort this server's fetches. The device stays for the next server (UBLK_F_QUIESCE).
    pub fn quiesce(&mut self, dev_id: DevId, timeout_ms: u64) -> Result<(), CtrlError> {
        self.exec(
            "QUIESCE_DEV",
            sys::UBLK_U_CMD_QUIESCE_DEV,
            dev_id,
            timeout_ms,
            None,
        )
        .map(drop)
    }

    /// `UPDATE_SIZE`: new capacity in 512-byte sectors (UBLK_F_UPDATE_SIZE).
    pub fn update_size(&mut self, dev_id: DevId, sectors: u64) -> Result<(), CtrlError> {
        self.exec(
            "UPDATE_SIZE",
            sys::UBLK_U_CMD_UPDATE_SIZE,
            dev_id,
            sectors,
            None,
        )
        .map(drop)
    }

    /// `UBLK_U_CMD_GET_FEATURES`: the feature flags this kernel's driver supports.
    pub fn features(&mut self) -> Result<Features, CtrlError> {
        const COMMAND: &str = "GET_FEATURES";
        let cmd = sys::ublksrv_ctrl_cmd {
            dev_id: u32::MAX,
            queue_id: u16::MAX,
            ..Default::default()
        };
        let buf = vec![0u8; usize::from(sys::UBLK_FEATURES_LEN)].into_boxed_slice();
        let (res, buf) = self.ring.uring_cmd(
            self.file.as_raw_fd(),
            sys::UBLK_U_CMD_GET_FEATURES,
            cmd,
            Some(buf),
            self.timeout,
        )?;
        if res < 0 {
            return Err(CtrlError::Command {
                command: COMMAND,
                source: io::Error::from_raw_os_error(-res),
            });
        }
        let bytes: [u8; 8] =
            buf.as_deref()
                .and_then(|b| b.try_into().ok())
                .ok_or(CtrlError::ShortReply {
                    command: COMMAND,
                    got: buf.as_ref().map_or(0, |b| b.len()),
                    want: 8,
                })?;
        Ok(Features(u64::from_ne_bytes(bytes)))
    }

    /// Whether ublk commands may share an IOPOLL ring with polled NVMe passthrough (Linux 7.1:
    /// "io_uring/uring_cmd: allow non-iopoll cmds with IORING_SETUP_IOPOLL"). Probed by sending
    /// GET_FEATURES on such a ring: older kernels refuse it with EOPNOTSUPP.
    pub fn iopoll_takes_ublk_cmds(&self) -> bool {
        let Ok(mut ring) = ControlRing::with_iopoll(2) else {
            return false;
        };
        let cmd = sys::ublksrv_ctrl_cmd {
            dev_id: u32::MAX,
            queue_id: u16::MAX,
            ..Default::default()
        };
        let buf = vec![0u8; usize::from(sys::UBLK_FEATURES_LEN)].into_boxed_slice();
        matches!(
            ring.uring_cmd(
                self.file.as_raw_fd(),
                sys::UBLK_U_CMD_GET_FEATURES,
                cmd,
                Some(buf),
                self.timeout,
            ),
            Ok((res, _)) if res >= 0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpumask_bits_are_cpu_numbers() {
        assert_eq!(cpus_of_mask(&[0b101, 0, 0b1000_0000]), vec![0, 2, 23]);
        assert!(cpus_of_mask(&[]).is_empty());
    }
}
