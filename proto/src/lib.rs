//! The ublkd wire API: protobuf definitions (package `ublkd.v1`, `proto/ublkd/v1/ublkd.proto`)
//! and the tonic code generated from them.
//!
//! What it is: messages and service stubs shared by the daemon (`server/`) and `ublkctl`
//! (`cli/`), plus the encoded file descriptor set for gRPC reflection.
//! What it is not: no I/O, and no validation beyond the API's own rules (`units` reads and
//! prints sizes, `is_volume_id` is the id rule). Both sides convert to their own types.
#![forbid(unsafe_code)]

pub use backend::BackendKind;

pub mod backend;
#[cfg(test)]
mod compat;
pub mod notation;
pub mod units;

/// Whether `id` is a valid volume id: a DNS label, 1-63 of `[a-z0-9-]`, starting and ending
/// with a letter or digit (the rule `Volume.id` documents; one definition for every side).
pub fn is_volume_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-')
}

/// The protobuf package every service of this API lives in.
pub const API_PACKAGE: &str = "ublkd.v1";

#[allow(clippy::all, missing_debug_implementations, unreachable_pub)]
pub mod v1 {
    tonic::include_proto!("ublkd.v1");
}

/// Encoded `FileDescriptorSet` of the API, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ublkd_descriptor.bin"));
