//! The one place where errors become gRPC statuses.

use crate::volumes::{Kind, VolumeError};
use tonic::{Code, Status};

/// The gRPC code for each kind of volume error.
pub fn code(kind: Kind) -> Code {
    match kind {
        Kind::InvalidArgument => Code::InvalidArgument,
        Kind::NotFound => Code::NotFound,
        Kind::AlreadyExists => Code::AlreadyExists,
        Kind::FailedPrecondition => Code::FailedPrecondition,
        Kind::PermissionDenied => Code::PermissionDenied,
        Kind::ResourceExhausted => Code::ResourceExhausted,
        Kind::Unimplemented => Code::Unimplemented,
        Kind::Unavailable => Code::Unavailable,
        Kind::Internal => Code::Internal,
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

impl From<VolumeError> for Status {
    fn from(e: VolumeError) -> Status {
        let code = code(e.kind());
        let message = chain(&e);
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
}
