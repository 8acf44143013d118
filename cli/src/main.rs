//! `ublkctl`, the command-line client of ublkd.
//!
//! What it is: subcommands (`create-volume`, `list-volumes`, ...) that speak the `ublkd.v1` gRPC
//! API to a running daemon. What it is not: it depends on the proto crate only, never on the
//! dataplane, and never touches a device itself.
//!
//! The subcommands arrive with the control-plane work; today it knows its version.

use std::process::ExitCode;

fn main() -> ExitCode {
    match std::env::args().nth(1).as_deref() {
        Some("--version") | Some("-V") => {
            println!(
                "ublkctl {} (API {})",
                env!("CARGO_PKG_VERSION"),
                ublkd_proto::API_PACKAGE
            );
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: ublkctl --version (volume commands arrive with the gRPC service)");
            ExitCode::from(2)
        }
    }
}
