//! ublkd end to end in the guest: a real daemon process, real gRPC (and ublkctl), real devices.
#![cfg(feature = "vm")]

mod admission;
mod lifecycle;
mod refusals;
mod service;
mod tls;

use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::time::Duration;
use tonic::Code;
use ublkd_proto::v1::{self, volume_spec::Backend};
use ublkd_tests::api::{self, create, file, nvme, volume as spec};
use ublkd_tests::daemon::{sample, Daemon};
use ublkd_tests::guest;
use ublkd_tests::MIB;

pub(crate) fn sectors(dev: &str) -> Result<u64> {
    let name = dev.trim_start_matches("/dev/");
    Ok(ublkd_tests::read_trimmed(format!("/sys/block/{name}/size"))?.parse()?)
}
