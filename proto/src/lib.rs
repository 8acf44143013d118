//! The ublkd wire API: protobuf definitions (package `ublkd.v1`, `proto/ublkd/v1/ublkd.proto`)
//! and the tonic code generated from them.
//!
//! What it is: messages and service stubs shared by the daemon (`server/`) and `ublkctl`
//! (`cli/`), plus the encoded file descriptor set for gRPC reflection.
//! What it is not: no validation and no I/O (`units` only reads and prints sizes). Both sides convert to their own types.

pub mod units;

/// The protobuf package every service of this API lives in.
pub const API_PACKAGE: &str = "ublkd.v1";

#[allow(clippy::all, missing_debug_implementations, unreachable_pub)]
pub mod v1 {
    tonic::include_proto!("ublkd.v1");
}

/// Encoded `FileDescriptorSet` of the API, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ublkd_descriptor.bin"));
