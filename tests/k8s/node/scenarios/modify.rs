//! VolumeAttributesClass: a claim's I/O limits changed live.

use crate::kube::{field, Mode, Sc};
use anyhow::{bail, ensure, Result};
use serde_json::json;

/// VolumeAttributesClasses on the install as it is, without remote access: no host port,
/// no client certificate. A claim's class changed three times: each becomes the claim's
/// current class once the node's ublkd holds its limits, and a 4 MiB/s write limit holds a
/// writer in the pod within 10 % of it (and lifted, the writer runs faster).
pub fn modify(s: &Sc) -> Result<()> {
    let ports = s.jp(&["-n", "ublkd-system", "ds", "ublkd"], "{..hostPort}")?;
    ensure!(
        ports.trim().is_empty(),
        "ublkd's pod has host ports: {ports}"
    );
    let logs = s.kw("-n ublkd-system logs deploy/ublkd-csi-resizer -c ublkd-csi")?;
    ensure!(
        logs.contains("recorded on the PersistentVolume"),
        "the resizer's driver does not record limits on PersistentVolumes: {logs}"
    );
    s.apply(
        "apiVersion: storage.k8s.io/v1
kind: VolumeAttributesClass
metadata: {name: m-capped}
driverName: ublkd.io
parameters: {writeBandwidth: 4Mi, qosBurst: 100ms}
",
    )?;
    s.pvc("m-data", "ublkd-file", "128Mi", Mode::Filesystem)?;
    s.pod("p-m", "m-data", Mode::Filesystem)?;
    let vol = s.volume_of("m-data")?;
    let qos = || -> Result<String> {
        Ok(field(&s.ublkctl(&format!("get-volume {vol}"))?, "qos")
            .unwrap_or_default()
            .to_owned())
    };
    s.say(format!("volume {vol}, qos: {}", qos()?));
    let applied = |class: &str| {
        let patch = json!({"spec": {"volumeAttributesClassName": class}}).to_string();
        s.k(&["patch", "pvc", "m-data", "-p", &patch])?;
        let current = "{.status.currentVolumeAttributesClassName}";
        let now = || s.jp_is(&["pvc", "m-data"], current, class);
        s.wait(180, &format!("the claim's class became {class}"), now)
            .inspect_err(|_| {
                s.tail(15, "describe pvc m-data");
                s.tail(20, &s.csi_node_logs());
                for c in ["csi-resizer", "ublkd-csi"] {
                    s.tail(
                        20,
                        &format!("-n ublkd-system logs deploy/ublkd-csi-resizer -c {c}"),
                    );
                }
            })?;
        let q = qos()?;
        s.say(format!("{class} applied, qos: {q}"));
        Ok::<_, anyhow::Error>(q)
    };
    // 32 MiB written and synced in the pod: bytes per second, timed by the guest's clock
    // (/proc/uptime, 10 ms; the pod's busybox dd prints no rate). Direct writes, so each MiB
    // meets the limit as it is written: buffered, the time also held dd's filling of the page
    // cache, unthrottled and as slow as a busy guest's CPU (10.08 s for 8 s of writes).
    let write_rate = || -> Result<f64> {
        let out = s.in_pod(
            "p-m",
            "rm -f /data/f; a=$(cut -d' ' -f1 /proc/uptime); \
             dd if=/dev/zero of=/data/f bs=1M count=32 oflag=direct conv=fsync 2>/dev/null && \
             echo \"$a $(cut -d' ' -f1 /proc/uptime)\"",
        )?;
        let t: Vec<f64> = (out.split_whitespace())
            .filter_map(|w| w.parse().ok())
            .collect();
        let [t0, t1] = t[..] else {
            bail!("no start and end time from the pod: {out:?}");
        };
        s.say(format!("32 MiB written and synced in {:.2} s", t1 - t0));
        Ok(32.0 * 1048576.0 / (t1 - t0))
    };
    let q = applied("ublkd-limited")?;
    let (r, w) = (q.find("read 5000 IOPS"), q.find("write 2000 IOPS"));
    ensure!(
        matches!((r, w), (Some(r), Some(w)) if r < w),
        "ublkd's limits are not ublkd-limited's ({q})"
    );
    applied("m-capped")?;
    let cap = 4.0 * 1024.0 * 1024.0;
    let capped = write_rate()?;
    s.say(format!(
        "capped at 4 MiB/s: {:.3} MiB/s",
        capped / 1048576.0
    ));
    ensure!(
        (capped / cap - 1.0).abs() <= 0.10,
        "the writer ran at {:.3} MiB/s under a 4 MiB/s limit (over 10 % off)",
        capped / 1048576.0
    );
    let q = applied("ublkd-unlimited")?;
    ensure!(q == "unlimited", "ublkd's limits were not lifted ({q})");
    let free = write_rate()?;
    s.say(format!("unlimited: {:.3} MiB/s", free / 1048576.0));
    ensure!(
        free > cap * 1.5,
        "lifted, the writer still ran at {:.3} MiB/s: the cap was not the limit",
        free / 1048576.0
    );
    s.delete("pod p-m")?;
    s.delete("pvc m-data")?;
    s.delete("volumeattributesclass m-capped")
}
