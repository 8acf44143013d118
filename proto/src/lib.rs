//! The ublkd wire API: protobuf definitions (package `ublkd.v1`) and the code generated from them.
//!
//! What it is: messages and service stubs shared by the daemon (`server/`) and `ublkctl` (`cli/`).
//! What it is not: no logic, no validation, no I/O. Both sides convert to their own types.
//!
//! The volume and node services arrive with the control-plane work; until then this crate only
//! names the API version both sides will speak.

/// The protobuf package every service of this API lives in.
pub const API_PACKAGE: &str = "ublkd.v1";
