//! An upgrade as a node has it (issue 56): the registry the build of b69c0a8 wrote
//! (`tests/fixtures/registry-b69c0a8`), over a backing file and an NVMe window that hold data,
//! is restored by this build: every volume READY, serving what was written before, its record
//! rewritten in the current format (the namespace's identity filled in), and a record of a
//! format newer than this build's refused at start, naming the file, with nothing deleted.
//! Its stops also hold that a client's idle connection (this test's own, left unpolled by its
//! synchronous steps) does not keep ublkd from stopping: it used to, for good.
#![cfg(feature = "vm")]

use anyhow::{ensure, Context, Result};
use std::path::Path;
use ublkd_tests::daemon::Daemon;
use ublkd_tests::guest;

const METRICS_PORT: u16 = 19660;
/// The namespace the fixture's NVMe volume has its window on (the guest's emulated one).
const NG: &str = "/dev/ng0n1";
const BLK: &str = "/dev/nvme0n1";
const MIB64: &str = "64";

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/registry-b69c0a8")
}

/// The fixture registry under `state`, its placeholders filled in.
fn install(state: &Path, root: &Path) -> Result<()> {
    for sub in ["registry", "snapshots"] {
        std::fs::create_dir_all(state.join(sub))?;
        for f in std::fs::read_dir(fixtures().join(sub))? {
            let f = f?.path();
            let body = std::fs::read_to_string(&f)?
                .replace("@ROOT@", &root.display().to_string())
                .replace("@NVME@", NG);
            let name = f.file_name().context("a fixture's name")?;
            std::fs::write(state.join(sub).join(name), body)?;
        }
    }
    Ok(())
}

fn md5(path: &str, mib: &str) -> Result<String> {
    let out = guest::sh(&format!(
        "dd if={path} bs=1M count={mib} iflag=direct status=none | md5sum"
    ))?;
    Ok(out.split_whitespace().next().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_registry_written_by_b69c0a8_comes_back_serving_its_data() -> Result<()> {
    let dir = guest::scratch("upgrade")?;
    let mut d = Daemon::new(&dir, METRICS_PORT, "")?;
    install(&d.state, &d.root)?;
    // What the old build's volumes held: a pattern in the backing file and in the window.
    let file = d.root.join("up-file.img");
    guest::sh(&format!(
        "dd if=/dev/urandom of={} bs=1M count={MIB64} status=none",
        file.display()
    ))?;
    guest::sh(&format!(
        "dd if=/dev/urandom of={BLK} bs=1M count={MIB64} oflag=direct status=none"
    ))?;
    let file_before = md5(&file.display().to_string(), MIB64)?;
    let nvme_before = md5(BLK, MIB64)?;

    d.start().await?;
    let ready = d.wait_all_ready().await?;
    let ids: Vec<&str> = ready.iter().map(|v| v.id.as_str()).collect();
    ensure!(
        ids == ["up-file", "up-null", "up-nvme"],
        "restored: {ids:?}\n{}",
        d.log()
    );
    let device = |id: &str| {
        ready
            .iter()
            .find(|v| v.id == id)
            .map(|v| v.device_path.clone())
            .unwrap_or_default()
    };
    ensure!(
        md5(&device("up-file"), MIB64)? == file_before,
        "the file volume serves other data than its backing file held"
    );
    ensure!(
        md5(&device("up-nvme"), MIB64)? == nvme_before,
        "the NVMe volume serves other data than its window held (erased?)"
    );
    let zeroes = guest::sh(&format!(
        "dd if={} bs=4096 count=16 iflag=direct status=none | tr -d '\\0' | wc -c",
        device("up-null")
    ))?;
    ensure!(zeroes.trim() == "0", "the null volume reads non-zero bytes");
    // Rewritten in this build's format, the namespace's identity filled in.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.state.join("registry/up-nvme.json"))?)?;
    ensure!(
        record["format"].as_u64() >= Some(2) && record["backend"]["identity"].is_string(),
        "the NVMe record was not brought to the current format: {record}"
    );
    // The limits and the claim came through.
    let got = d.ublkctl_ok(&["-o", "json", "get-volume", "up-file"])?;
    ensure!(
        got.contains("104857600") && got.contains("\"data\""),
        "up-file's write limit or claim was lost: {got}"
    );
    // Where each of ublkd's threads waits 20 s into the stop, shown if the stop hangs.
    let pid = d.pid().context("ublkd's pid")?;
    let stacks = dir.join("stacks.txt");
    guest::sh(&format!(
        "(sleep 20; for t in /proc/{pid}/task/*; do echo \"== $(cat $t/comm) $(cat $t/wchan)\"; \
         cat $t/stack; done > {} 2>&1) >/dev/null 2>&1 &",
        stacks.display()
    ))?;
    d.stop_with(libc::SIGTERM).map_err(|e| {
        let seen = std::fs::read_to_string(&stacks).unwrap_or_default();
        e.context(format!("ublkd's threads 20 s into the stop:\n{seen}"))
    })?;

    // A record a newer build wrote: this one refuses to start, says which file, keeps it.
    let newer = d.state.join("registry/up-null.json");
    let mut value: serde_json::Value = serde_json::from_slice(&std::fs::read(&newer)?)?;
    value["format"] = 99.into();
    let body = serde_json::to_vec_pretty(&value)?;
    std::fs::write(&newer, &body)?;
    let refused = d.start().await;
    ensure!(refused.is_err(), "ublkd started over a record of format 99");
    ensure!(
        d.log().contains("up-null.json") && d.log().contains("format 99"),
        "the refusal does not name the file and its format:\n{}",
        d.log()
    );
    ensure!(
        std::fs::read(&newer)? == body,
        "the newer record was changed"
    );
    ensure!(
        md5(&file.display().to_string(), MIB64)? == file_before,
        "the backing file changed"
    );
    // Back to a format this build reads: everything comes back, then goes.
    value["format"] = 2.into();
    std::fs::write(&newer, serde_json::to_vec_pretty(&value)?)?;
    d.start().await?;
    d.wait_all_ready().await?;
    // This runtime closes that wait's connection while it sleeps: the last stop (the drop's)
    // then has none to wait 10 s for.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for id in ["up-file", "up-nvme", "up-null"] {
        d.ublkctl_ok(&["delete-volume", id])?;
    }
    Ok(())
}
