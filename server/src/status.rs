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
        let code = code(e.kind());
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
