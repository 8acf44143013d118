//! The driver's binary stops on the signal Kubernetes sends a container: SIGTERM.

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long the test waits for the driver to start or to stop: a hang's guard, not a measure.
const GUARD: Duration = Duration::from_secs(60);

#[test]
fn sigterm_stops_the_driver_cleanly_and_removes_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let no_ublkd = dir.path().join("ublkd.sock");
    let mut driver = Command::new(env!("CARGO_BIN_EXE_ublkd-csi"))
        .arg(format!("--csi-endpoint=unix://{}", socket.display()))
        .arg(format!("--ublkd=unix://{}", no_ublkd.display()))
        .arg("--node-id=node-a")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !socket.exists() {
        assert!(started.elapsed() < GUARD, "the driver made no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = driver.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let asked = Instant::now();
    let status = loop {
        if let Some(status) = driver.try_wait().unwrap() {
            break status;
        }
        if asked.elapsed() > GUARD {
            driver.kill().unwrap();
            panic!("the driver still runs {GUARD:?} after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    driver
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    // Killed by the signal (no handler: a container's PID 1 would ignore it) is not a success.
    assert!(
        status.success(),
        "SIGTERM ended the driver with {status}:\n{log}"
    );
    assert!(
        log.contains("SIGTERM"),
        "the driver did not say why it stopped:\n{log}"
    );
    assert!(!socket.exists(), "the driver left its socket behind");
}
