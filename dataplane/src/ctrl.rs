//! The ublk control device, `/dev/ublk-control`: feature probe and device lifecycle commands.
//!
//! Commands run on a [`ControlRing`] of their own, never on a worker's ring, each bounded by a
//! timeout.

use crate::features::Features;
use crate::ring::{ControlRing, RingError};
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
    #[error("{command} returned {got} bytes, expected {want}")]
    ShortReply {
        command: &'static str,
        got: usize,
        want: usize,
    },
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
}
