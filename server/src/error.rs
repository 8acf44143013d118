//! The server's errors, and the one place where they become gRPC statuses.

use crate::registry::RegistryError;
use std::path::PathBuf;
use tonic::{Code, Status};
use ublkd_dataplane::{DataplaneError, ErrorKind};

/// Errors of volume operations; `code()` below is the one place they become gRPC codes.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Precondition(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Exhausted(String),
    #[error("{0}")]
    Unimplemented(String),
    #[error("the kernel has no ublk driver (modprobe ublk_drv): {0}")]
    NoUblk(String),
    #[error("dataplane")]
    Dataplane(#[from] DataplaneError),
    #[error("registry")]
    Registry(#[from] RegistryError),
    #[error("backing file {path}")]
    BackingFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("internal: {0}")]
    Internal(String),
}

impl VolumeError {
    /// The gRPC code a client gets for this error.
    pub fn code(&self) -> Code {
        match self {
            VolumeError::Invalid(_) => Code::InvalidArgument,
            VolumeError::NotFound(_) => Code::NotFound,
            VolumeError::AlreadyExists(_) => Code::AlreadyExists,
            VolumeError::Precondition(_) | VolumeError::NoUblk(_) => Code::FailedPrecondition,
            VolumeError::PermissionDenied(_) => Code::PermissionDenied,
            VolumeError::Exhausted(_) => Code::ResourceExhausted,
            VolumeError::Unimplemented(_) => Code::Unimplemented,
            VolumeError::Dataplane(e) => dataplane_code(e.kind()),
            VolumeError::BackingFile { .. } => Code::FailedPrecondition,
            VolumeError::Registry(_) | VolumeError::Internal(_) => Code::Internal,
        }
    }
}

/// The gRPC code for each kind of dataplane error.
fn dataplane_code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    }
}

/// An error and its causes, joined: what a person needs to act on it.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let msg = s.to_string();
        if !out.ends_with(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        cur = s.source();
    }
    out
}

/// The longest status message sent: it travels in an HTTP/2 header, and a client's oversized
/// input echoed whole would break the response ("h2 protocol error") instead of explaining it.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `m` cut to [`MAX_MESSAGE_BYTES`] at a character boundary.
pub fn bounded(mut m: String) -> String {
    if m.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES - 3;
        while !m.is_char_boundary(end) {
            end -= 1;
        }
        m.truncate(end);
        m.push('…');
    }
    m
}

impl From<VolumeError> for Status {
    fn from(e: VolumeError) -> Status {
        let code = e.code();
        let message = bounded(chain(&e));
        if code == Code::Internal {
            tracing::error!(error = %message, "internal error");
        }
        Status::new(code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_codes_and_keep_their_cause() {
        let s: Status = VolumeError::NotFound("volume \"x\" does not exist".into()).into();
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(s.message(), "volume \"x\" does not exist");
        let io = std::io::Error::from_raw_os_error(2);
        let s: Status = VolumeError::BackingFile {
            path: "/v.img".into(),
            source: io,
        }
        .into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().starts_with("backing file /v.img: No such file"));
        let s: Status = VolumeError::from(ublkd_dataplane::DataplaneError::Spec(
            ublkd_dataplane::SpecError::SizeZero,
        ))
        .into();
        assert_eq!(s.code(), Code::InvalidArgument);
    }

    #[test]
    fn every_error_has_its_code() {
        let io = || std::io::Error::from_raw_os_error(5);
        let table: Vec<(VolumeError, Code)> = vec![
            (VolumeError::Invalid("x".into()), Code::InvalidArgument),
            (VolumeError::NotFound("x".into()), Code::NotFound),
            (VolumeError::AlreadyExists("x".into()), Code::AlreadyExists),
            (
                VolumeError::Precondition("x".into()),
                Code::FailedPrecondition,
            ),
            (VolumeError::NoUblk("x".into()), Code::FailedPrecondition),
            (
                VolumeError::PermissionDenied("x".into()),
                Code::PermissionDenied,
            ),
            (VolumeError::Exhausted("x".into()), Code::ResourceExhausted),
            (VolumeError::Unimplemented("x".into()), Code::Unimplemented),
            (
                VolumeError::BackingFile {
                    path: "/v".into(),
                    source: io(),
                },
                Code::FailedPrecondition,
            ),
            (
                VolumeError::Registry(RegistryError::Write {
                    id: "v".into(),
                    source: io(),
                }),
                Code::Internal,
            ),
            (VolumeError::Internal("x".into()), Code::Internal),
        ];
        for (e, code) in table {
            assert_eq!(e.code(), code, "{e:?}");
            assert_eq!(Status::from(e).code(), code);
        }
        let kinds = [
            (ErrorKind::InvalidArgument, Code::InvalidArgument),
            (ErrorKind::NotFound, Code::NotFound),
            (ErrorKind::AlreadyExists, Code::AlreadyExists),
            (ErrorKind::FailedPrecondition, Code::FailedPrecondition),
            (ErrorKind::ResourceExhausted, Code::ResourceExhausted),
            (ErrorKind::Unavailable, Code::Unavailable),
            (ErrorKind::Internal, Code::Internal),
        ];
        for (kind, code) in kinds {
            assert_eq!(dataplane_code(kind), code, "{kind:?}");
        }
    }

    #[test]
    fn messages_are_bounded() {
        let long = "é".repeat(5000);
        let s: Status = VolumeError::Invalid(long).into();
        assert!(
            s.message().len() <= MAX_MESSAGE_BYTES,
            "{}",
            s.message().len()
        );
        assert!(s.message().ends_with('…'));
    }
}
