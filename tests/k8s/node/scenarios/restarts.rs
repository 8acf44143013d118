//! ublkd and the kubelet restarted under live volumes: I/O pauses, nothing is lost.

use super::encrypted::{luks_classes, luks_classes_gone};
use super::kill_ublkd;
use crate::kube::{fill, localw, words, Mode, Sc, NODE, UBLKD_PODS};
use anyhow::{ensure, Context, Result};
use std::fs;
use std::path::Path;
use std::time::Duration;

/// Two pods write with fsync (each write a new block, each checked), one of them through
/// dm-crypt (`encryption: luks2`), while ublkd is killed with SIGKILL and then upgraded to a new image the way docs/kubernetes.md ("Upgrading") says (helm
/// upgrade, then the node's pod deleted: OnDelete). The devices wait for the next ublkd; the
/// writers end with no I/O error.
pub fn ublkd_restart(s: &Sc) -> Result<()> {
    // Two writers: one on a plain file volume, one through dm-crypt on an encrypted one.
    luks_classes(s, "right-key-51c7")?;
    let writers = [
        ("p-writer", "w-data", "ublkd-file"),
        ("p-e-writer", "we-data", "ublkd-file-luks"),
    ];
    for (pod, claim, class) in writers {
        s.pvc(claim, class, "64Mi", Mode::Filesystem)?;
        s.apply(&fill(
            r#"apiVersion: v1
kind: Pod
metadata: {name: @POD@}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: ublkd.test/busybox:test
      command:
        - /bin/sh
        - -c
        - |
          i=0
          while [ ! -e /data/stop ]; do
            echo "block $i" | dd of=/data/log bs=4096 seek=$((i % 8192)) conv=fsync,notrunc 2>/tmp/err ||
              { echo "write $i failed: $(cat /tmp/err)"; exit 1; }
            i=$((i + 1))
          done
          echo "wrote $i blocks with fsync, none failed"
      volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: @CLAIM@}}]
"#,
            &[("POD", pod), ("CLAIM", claim)],
        ))?;
    }
    for (pod, claim, _) in writers {
        s.ready(pod, claim)?;
    }
    // The writers loop from Ready until /data/stop: two seconds in, the kill finds writes in flight.
    std::thread::sleep(Duration::from_secs(2));
    let before = s.ublkd_restarts()?;
    s.say(format!("ublkd's restarts: {before}"));
    kill_ublkd(s)?;
    let restarted = || s.ublkd_restarts().is_ok_and(|n| n > before) && s.ublkd_ready();
    s.wait(600, "ublkd back after SIGKILL", restarted)
        .inspect_err(|_| {
            let pod = s.ublkd_pod().unwrap_or_default();
            s.tail(20, &format!("-n ublkd-system describe pod {pod}"));
        })?;
    for (pod, _, _) in writers {
        s.say(format!(
            "{pod}: {}",
            s.jp(&["pod", pod], "{.status.phase}")?
        ));
    }
    // The roll, as docs/kubernetes.md ("Upgrading") says: helm upgrade to a new image tag (the
    // same build pushed to the node's registry as :roll), then the node's pod deleted.
    let old = s.ublkd_pod()?;
    // The packaged chart pins its image by digest: the roll names a tag instead.
    let roll = words("--reuse-values --set image.tag=roll --set image.digest=");
    s.helm_chart("upgrade", &roll)?;
    s.say(s.helmw("history ublkd --namespace ublkd-system")?);
    let on_node = format!("spec.nodeName={NODE}");
    s.delete(&format!("{UBLKD_PODS} --field-selector {on_node}"))?;
    let image = r#"{.spec.containers[?(@.name=="ublkd")].image}"#;
    let rolled = || {
        s.ublkd_pod().is_ok_and(|p| {
            p != old
                && s.jp(&["-n", "ublkd-system", "pod", &p], image)
                    .is_ok_and(|i| i.ends_with(":roll"))
        }) && s.ublkd_ready()
    };
    s.wait(600, "the rolled ublkd pod Ready", rolled)
        .inspect_err(|_| s.show("-n ublkd-system get pods -o wide"))?;
    std::thread::sleep(Duration::from_secs(2));
    for (pod, _, _) in writers {
        // The writer may see the file and end, and its PID namespace take the exec's shell
        // with it (SIGKILL, 137), before the exec returns: stop 48's CI failed that way.
        // Whether the writer ended cleanly is what is judged.
        if let Err(e) = s.in_pod(pod, "touch /data/stop") {
            s.say(format!("(the exec that stops {pod}: {e:#})"));
        }
    }
    for (pod, _, _) in writers {
        let done = || s.jp_is(&["pod", pod], "{.status.phase}", "Succeeded");
        s.wait(300, &format!("{pod} finished cleanly"), done)
            .inspect_err(|_| {
                s.tail(5, &format!("logs {pod}"));
                s.tail(20, &format!("describe pod {pod}"));
                if let Ok(k) = localw("dmesg") {
                    let k: Vec<_> = k.lines().rev().take(40).collect();
                    s.say(format!("dmesg, newest first:\n{}", k.join("\n")));
                }
            })?;
        s.show(&format!("logs {pod}"));
    }
    s.delete("pod p-writer p-e-writer")?;
    s.delete("pvc w-data we-data")?;
    luks_classes_gone(s)
}

/// The running kubelet's pid (the node's kubelet service writes it).
fn kubelet_pid() -> Option<u32> {
    fs::read_to_string("/run/kubelet.pid")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The kubelet stopped with SIGTERM; the node's kubelet service starts it again, as systemd would.
pub(super) fn restart_kubelet(s: &Sc) -> Result<()> {
    let old = kubelet_pid().context("no kubelet pid")?;
    localw(&format!("kill {old}"))?;
    let alive = |pid: u32| Path::new(&format!("/proc/{pid}")).exists();
    s.wait(30, "the kubelet stopped", || !alive(old))?;
    s.wait(60, "the kubelet started again", || {
        kubelet_pid().is_some_and(|p| p != old && alive(p))
    })
}

/// The kubelet restarted: the mounted volume stays mounted and keeps its data, the registrar
/// registers the driver again, and a new pod still gets a new volume.
pub fn kubelet_restart(s: &Sc) -> Result<()> {
    s.pvc("k-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-keep", "k-data", Mode::Filesystem)?;
    s.in_pod("p-keep", "echo kept >/data/f && sync")?;
    restart_kubelet(s)?;
    s.wait(600, "the node Ready again", || s.node_ready())?;
    // The new kubelet takes the running pods back before it answers for them.
    s.wait(300, "the kubelet took p-keep back", || {
        s.qw("exec p-keep -- /bin/sh -c true").is_ok()
    })?;
    s.wait(300, "the driver registered after the restart", || {
        s.registered()
    })?;
    let got = s.in_pod("p-keep", "cat /data/f")?;
    ensure!(got == "kept", "the mounted volume kept its data ({got})");
    s.pvc("k-new", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-new", "k-new", Mode::Filesystem)?;
    s.in_pod("p-new", "echo new >/data/f && sync")?;
    s.say("a new pod got a volume after the restart");
    s.delete("pod p-keep p-new")?;
    s.delete("pvc k-data k-new")
}
