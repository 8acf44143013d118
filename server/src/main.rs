//! `ublkd`, the storage-node daemon.
//!
//! What it is: the process that owns the dataplane's workers and exposes volume lifecycle over
//! gRPC, metrics over HTTP and configuration from file and environment.
//! What it is not: it never touches an io_uring or calls libc for I/O; that is the dataplane's job.
//!
//! Today it answers `ublkd probe`: open `/dev/ublk-control` and print what the kernel offers. The
//! gRPC service arrives with the control-plane work.

use anyhow::Context;
use std::process::ExitCode;

const USAGE: &str = "usage: ublkd probe | ublkd --version";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("probe") => match probe() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ublkd: {e:#}");
                ExitCode::FAILURE
            }
        },
        Some("--version") | Some("-V") => {
            println!("ublkd {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("--help") | Some("-h") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn probe() -> anyhow::Result<()> {
    let mut ctrl = ublkd_dataplane::ControlDevice::open()?;
    let features = ctrl.features().context("probing ublk features")?;
    println!("ublk features: {:#x}", features.0);
    for name in features.names() {
        println!("  {name}");
    }
    if features.unknown_bits() != 0 {
        println!("  (unknown bits {:#x})", features.unknown_bits());
    }
    Ok(())
}
