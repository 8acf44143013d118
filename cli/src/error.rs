//! What can go wrong, worded for the person at the terminal, and the exit code of each.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use tonic::{Code, ConnectError, Status, TimeoutExpired};

/// A failed command. Clap reports its own usage errors (exit 2) before any of these exist.
#[derive(Debug)]
pub enum Error {
    /// The command line is wrong in a way clap cannot see (TLS options for a plain endpoint, an
    /// unreadable certificate). Exit 2, like clap's own usage errors.
    Usage(String),
    /// The daemon cannot be reached. Exit 3.
    Unreachable { endpoint: String, cause: String },
    /// TLS failed: one side refused the other's certificate (the message says which, and
    /// what to do). No call was made, so, like an unreachable daemon, exit 3.
    Tls(String),
    /// The daemon answered with an error. Exit 1.
    Status(Status),
    /// `node-info --ready`: the daemon answers but serves no volume; why. Exit 4.
    NotReady(String),
    /// An answer could not be written as JSON (the API's descriptors do not describe it).
    /// Exit 1.
    Encode(String),
}

impl Error {
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Status(_) | Error::Encode(_) => 1,
            Error::Usage(_) => 2,
            Error::Unreachable { .. } | Error::Tls(_) => 3,
            Error::NotReady(_) => 4,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(msg) | Error::Tls(msg) => f.write_str(msg),
            Error::Encode(why) => write!(f, "writing the answer as JSON: {why}"),
            Error::NotReady(why) => write!(f, "not ready: ublkd serves no volume: {why}"),
            Error::Unreachable { endpoint, cause } => {
                write!(
                    f,
                    "cannot reach ublkd at {endpoint}: {cause}: is it running?"
                )
            }
            Error::Status(status) if status.message().is_empty() => {
                f.write_str(code_name(status.code()))
            }
            Error::Status(status) => {
                write!(f, "{}: {}", code_name(status.code()), status.message())
            }
        }
    }
}

impl Error {
    /// The error of a call to `endpoint` made with `timeout`. Two statuses come from the
    /// channel, not the daemon, and are reworded: a channel that loses the daemon and cannot
    /// reconnect fails with UNAVAILABLE caused by a connect error (the daemon is unreachable),
    /// and the channel's own deadline timer fails with CANCELLED "Timeout expired" (the deadline
    /// passed without a reply).
    pub fn from_status(status: Status, endpoint: &str, timeout: Duration) -> Self {
        if chain(status.source()).any(|e| e.is::<TimeoutExpired>()) {
            return Error::no_reply(endpoint, timeout);
        }
        let lost = status.code() == Code::Unavailable
            && chain(status.source()).any(|e| e.is::<ConnectError>());
        if lost {
            return Error::Unreachable {
                endpoint: endpoint.to_owned(),
                cause: status.message().to_owned(),
            };
        }
        Error::Status(status)
    }

    /// The call's deadline passed without a reply. A daemon that accepted the connection is
    /// there, so this is DEADLINE_EXCEEDED (exit 1), not unreachable.
    pub fn no_reply(endpoint: &str, timeout: Duration) -> Self {
        Error::Status(Status::deadline_exceeded(format!(
            "no reply from ublkd at {endpoint} within {}s",
            timeout.as_secs()
        )))
    }
}

/// The gRPC code as words: `NotFound` is "not found".
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid argument",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

fn chain<'a>(
    first: Option<&'a (dyn StdError + 'static)>,
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(first, |&e| e.source())
}

impl From<ublkd_client::ConnectError> for Error {
    fn from(e: ublkd_client::ConnectError) -> Self {
        use ublkd_client::ConnectError as C;
        match e {
            C::ReadTlsFile { what, path, source } => {
                Error::Usage(format!("cannot read --{what} {}: {source}", path.display()))
            }
            C::BadTlsFile { what, path, reason } => {
                Error::Usage(format!("--{what} {}: {reason}", path.display()))
            }
            C::HalfIdentity | C::BadUri { .. } | C::BadServerName { .. } => {
                Error::Usage(e.to_string())
            }
            C::TlsSetup(_) | C::ServerCertificate { .. } | C::ClientCertificateRefused { .. } => {
                Error::Tls(e.to_string())
            }
            C::Unreachable { endpoint, cause } => Error::Unreachable { endpoint, cause },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn the_channel_deadline_reads_as_deadline_exceeded() {
        let status = Status::from_error(Box::new(TimeoutExpired(())));
        assert_eq!(status.code(), Code::Cancelled, "what tonic makes of it");
        let err = Error::from_status(status, "unix:///s", Duration::from_secs(2));
        assert_eq!(err.exit_code(), 1);
        assert_eq!(
            err.to_string(),
            "deadline exceeded: no reply from ublkd at unix:///s within 2s"
        );
    }

    #[test]
    fn statuses_read_as_code_then_message() {
        let err = Error::from_status(
            Status::not_found("volume \"x\" does not exist"),
            "e",
            SECOND,
        );
        assert_eq!(err.to_string(), "not found: volume \"x\" does not exist");
        assert_eq!(err.exit_code(), 1);
        assert_eq!(
            Error::from_status(Status::new(Code::FailedPrecondition, ""), "e", SECOND).to_string(),
            "failed precondition"
        );
    }

    #[test]
    fn a_server_unavailable_answer_is_still_an_answer() {
        assert_eq!(
            Error::from_status(Status::unavailable("draining"), "e", SECOND).exit_code(),
            1
        );
    }

    #[test]
    fn a_refused_certificate_is_exit_3_in_the_clients_words() {
        let err = Error::from(ublkd_client::ConnectError::ClientCertificateRefused {
            endpoint: "https://n1:7443".into(),
            cert: Some("/c/me.pem".into()),
            problem: ublkd_client::ClientCertProblem::Expired,
        });
        assert_eq!(err.exit_code(), 3);
        let text = err.to_string();
        assert!(
            text.starts_with("ublkd at https://n1:7443 refused this client's certificate /c/me.pem: it has expired"),
            "{text}"
        );
        assert!(!text.contains("is it running"), "{text}");
        assert_eq!(
            Error::from(ublkd_client::ConnectError::HalfIdentity).exit_code(),
            2
        );
    }

    #[test]
    fn a_lost_connection_is_unreachable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let status = Status::from_error(Box::new(ConnectError(Box::new(io))));
        assert_eq!(status.code(), Code::Unavailable);
        let err = Error::from_status(status, "unix:///s", SECOND);
        assert_eq!(err.exit_code(), 3);
        assert_eq!(
            err.to_string(),
            "cannot reach ublkd at unix:///s: refused: is it running?"
        );
    }
}
