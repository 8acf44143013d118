//! The volume and worker families, built at scrape time from one snapshot of the dataplane's
//! statistics (one round trip for every device, one for the workers).

use super::text::{family, Kind};
use crate::volume::{State, Volume};
use crate::volumes::Volumes;
use ublkd_dataplane::stats::{CleanupStep, BATCH_BOUNDS, LATENCY_BOUNDS};
use ublkd_dataplane::{DeviceStats, OpKind};

/// Appends every volume and worker family to `out`; `all` is every volume with its statistics,
/// read once for the whole scrape.
pub async fn write(volumes: &Volumes, all: &[(Volume, Option<DeviceStats>)], out: &mut String) {
    let orphans = volumes.orphans().await.len();
    let without_pv = volumes.without_pv().await.len();
    let workers = volumes.workers().await;
    let control_cleanup = volumes.control_cleanup_errors().await;
    write_volumes(all, out);
    let with_stats = || all.iter().filter_map(|(v, s)| Some((v, s.as_ref()?)));
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_io_ops_total",
        "I/O requests completed",
        Kind::Counter,
        |f, l, st| {
            for op in OpKind::ALL {
                f.counter(
                    &[l[0], l[1], l[2], ("op", op.name())],
                    st.total.ops_of(op) as f64,
                );
            }
        },
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_io_bytes_total",
        "Bytes moved by completed I/O",
        Kind::Counter,
        |f, l, st| {
            for op in OpKind::ALL {
                f.counter(
                    &[l[0], l[1], l[2], ("op", op.name())],
                    st.total.bytes_of(op) as f64,
                );
            }
        },
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_io_errors_total",
        "I/O requests failed",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.errors as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_protocol_errors_total",
        "ublk commands that failed unexpectedly; each stops a queue",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.protocol_errors as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_io_retries_total",
        "Backend operations sent again after a passing failure (NVMe path errors, resets)",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.retries as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_io_duration_seconds",
        "Time from the request reaching ublkd to its completion, by op (ops seen so far)",
        Kind::Histogram,
        |f, l, st| {
            for op in OpKind::ALL {
                let lat = st.total.latency_of(op);
                if lat.count() > 0 {
                    f.histogram(
                        &[l[0], l[1], l[2], ("op", op.name())],
                        &LATENCY_BOUNDS,
                        &lat.buckets,
                        lat.sum_ns as f64 / 1e9,
                    );
                }
            }
        },
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_throttled_requests_total",
        "Requests that waited for the volume's QoS limits before they started",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.throttled as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_throttled_seconds_total",
        "Time requests waited for the volume's QoS limits, summed",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.throttled_ns as f64 / 1e9),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_throttle_overruns_total",
        "Requests over the volume's limits served at once because no timer could be armed",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.throttle_overruns as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_zero_copy_fallbacks_total",
        "Requests served by copy because the kernel could not lend their pages (zero copy on)",
        Kind::Counter,
        |f, l, st| f.counter(l, st.total.zero_copy_fallbacks as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_copy_buffer_bytes",
        "Memory of the volume's registered copy buffers (0 with zero copy)",
        Kind::Gauge,
        |f, l, st| f.gauge(l, st.total.copy_buffer_bytes as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_last_protocol_errno",
        "errno of the volume's latest ublk protocol error (0: none)",
        Kind::Gauge,
        |f, l, st| f.gauge(l, st.total.last_protocol_errno as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_inflight_ios",
        "I/O requests in flight",
        Kind::Gauge,
        |f, l, st| f.gauge(l, st.total.inflight as f64),
    );
    per_volume(
        out,
        with_stats(),
        "ublkd_volume_memory_bytes",
        "Memory held by the backend",
        Kind::Gauge,
        |f, l, st| f.gauge(l, st.memory_bytes as f64),
    );
    write_workers(&workers, &control_cleanup, out);
    family(
        out,
        "ublkd_volumes",
        "Volumes known to this node",
        Kind::Gauge,
        |f| f.gauge(&[], all.len() as f64),
    );
    let (counts, sum_ns) = volumes.recoveries.durations.load();
    family(
        out,
        "ublkd_volume_recoveries_total",
        "Kernel devices taken over from a previous ublkd (after a crash or an upgrade)",
        Kind::Counter,
        |f| f.counter(&[], counts.iter().sum::<u64>() as f64),
    );
    let rollbacks = volumes.rollback_failures();
    family(
        out,
        "ublkd_volume_rollback_failures_total",
        "Refused changes (resize, QoS) whose record could not be put back: the next start \
         applies them",
        Kind::Counter,
        |f| f.counter(&[], rollbacks as f64),
    );
    let bounds = crate::volumes::RECOVERY_BOUNDS_NS.map(|ns| ns as f64 / 1e9);
    family(
        out,
        "ublkd_volume_recovery_duration_seconds",
        "Time to take over one device: start of recovery to I/O flowing",
        Kind::Histogram,
        |f| f.histogram(&[], &bounds, &counts, sum_ns as f64 / 1e9),
    );
    family(
        out,
        "ublkd_orphan_devices",
        "ublk devices in the kernel that no registered volume owns",
        Kind::Gauge,
        |f| f.gauge(&[], orphans as f64),
    );
    family(
        out,
        "ublkd_volumes_without_pv",
        "Volumes that no Kubernetes PersistentVolume names, as the CSI driver reports them \
         (their node was deleted, or they were made by hand); never deleted by ublkd",
        Kind::Gauge,
        |f| f.gauge(&[], without_pv as f64),
    );
    let up = volumes.dataplane_error().is_none();
    family(
        out,
        "ublkd_dataplane_up",
        "1 while the ublk dataplane runs; 0 when it could not start (no ublk driver, or one \
         without user recovery): the node serves no volume and offers no capacity",
        Kind::Gauge,
        |f| f.gauge(&[], f64::from(u8::from(up))),
    );
}

/// One family with samples from each volume that has statistics.
fn per_volume<'a>(
    out: &mut String,
    vols: impl Iterator<Item = (&'a Volume, &'a DeviceStats)>,
    name: &'static str,
    help: &'static str,
    kind: Kind,
    mut sample: impl FnMut(&mut super::text::Family<'_>, &[(&str, &str)], &DeviceStats),
) {
    family(out, name, help, kind, |f| {
        for (vol, st) in vols {
            let (ns, pvc) = claim_labels(vol);
            sample(
                f,
                &[
                    ("volume", &vol.record.id),
                    ("pvc_namespace", ns),
                    ("pvc", pvc),
                ],
                st,
            );
        }
    });
}

/// The claim a volume was made for, as labels: `(namespace, name)`, empty for a volume made
/// by hand (Prometheus reads an empty label as absent).
fn claim_labels(vol: &Volume) -> (&str, &str) {
    vol.record
        .claim
        .as_ref()
        .map_or(("", ""), |c| (c.namespace.as_str(), c.name.as_str()))
}

/// The families every volume has, statistics or not: size, state, attributes.
fn write_volumes(all: &[(Volume, Option<DeviceStats>)], out: &mut String) {
    family(
        out,
        "ublkd_volume_size_bytes",
        "Volume capacity",
        Kind::Gauge,
        |f| {
            for (vol, _) in all {
                let (ns, pvc) = claim_labels(vol);
                f.gauge(
                    &[
                        ("volume", &vol.record.id),
                        ("pvc_namespace", ns),
                        ("pvc", pvc),
                    ],
                    vol.record.size_bytes as f64,
                );
            }
        },
    );
    family(
        out,
        "ublkd_volume_state",
        "1 for the volume's current state",
        Kind::Gauge,
        |f| {
            for (vol, _) in all {
                let (ns, pvc) = claim_labels(vol);
                for s in State::ALL {
                    f.gauge(
                        &[
                            ("volume", &vol.record.id),
                            ("pvc_namespace", ns),
                            ("pvc", pvc),
                            ("state", s.name()),
                        ],
                        f64::from(u8::from(s == vol.state)),
                    );
                }
            }
        },
    );
    family(
        out,
        "ublkd_volume_info",
        "Volume attributes; always 1",
        Kind::Gauge,
        |f| {
            for (vol, _) in all {
                let backend = vol.record.backend.kind().name();
                let dev = vol.device.as_ref();
                // As node_exporter names it (`ublkb0`), so the two join on `device`.
                let device = dev
                    .and_then(|d| d.block_device.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let on_off = |b: bool| if b { "on" } else { "off" };
                let (ns, pvc) = claim_labels(vol);
                f.gauge(
                    &[
                        ("volume", &vol.record.id),
                        ("pvc_namespace", ns),
                        ("pvc", pvc),
                        ("backend", backend),
                        ("device", &device),
                        ("io_path", dev.map_or("", |d| d.io_path.name())),
                        (
                            "zero_copy",
                            dev.map_or("", |d| on_off(d.zero_copy_in_use())),
                        ),
                        ("poll", dev.map_or("", |d| on_off(d.polled))),
                    ],
                    1.0,
                );
            }
        },
    );
}

fn write_workers(
    workers: &[ublkd_dataplane::WorkerSnapshot],
    control_cleanup: &[(CleanupStep, u64)],
    out: &mut String,
) {
    let cpus: Vec<String> = workers.iter().map(|w| w.cpu.to_string()).collect();
    let each = || workers.iter().zip(cpus.iter().map(String::as_str));
    let bounds: Vec<f64> = BATCH_BOUNDS.iter().map(|&b| b as f64).collect();
    family(
        out,
        "ublkd_worker_batch_size",
        "Requests started per worker loop iteration",
        Kind::Histogram,
        |f| {
            for (w, cpu) in each() {
                f.histogram(
                    &[("worker", cpu)],
                    &bounds,
                    &w.batch_buckets,
                    w.batch_sum as f64,
                );
            }
        },
    );
    family(
        out,
        "ublkd_worker_busy_seconds_total",
        "Time workers spent handling completions",
        Kind::Counter,
        |f| {
            for (w, cpu) in each() {
                f.counter(&[("worker", cpu)], w.busy_seconds);
            }
        },
    );
    family(
        out,
        "ublkd_worker_idle_seconds_total",
        "Time workers spent waiting for work",
        Kind::Counter,
        |f| {
            for (w, cpu) in each() {
                f.counter(&[("worker", cpu)], w.idle_seconds);
            }
        },
    );
    family(
        out,
        "ublkd_worker_up",
        "1 while the worker serves; 0 once a fatal ring error stopped it",
        Kind::Gauge,
        |f| {
            for (w, cpu) in each() {
                f.gauge(
                    &[("worker", cpu)],
                    if w.down_errno.is_none() { 1.0 } else { 0.0 },
                );
            }
        },
    );
    family(
        out,
        "ublkd_worker_pinned",
        "1 while the worker's thread runs pinned to its CPU; 0 when pinning failed",
        Kind::Gauge,
        |f| {
            for (w, cpu) in each() {
                f.gauge(&[("worker", cpu)], if w.pinned { 1.0 } else { 0.0 });
            }
        },
    );
    family(
        out,
        "ublkd_worker_cleanup_errors_total",
        "Clean-up steps of the dataplane that failed, by worker (its CPU, or control) and step",
        Kind::Counter,
        |f| {
            for (w, cpu) in each() {
                for (step, n) in &w.cleanup_errors {
                    f.counter(&[("worker", cpu), ("step", step.name())], *n as f64);
                }
            }
            for (step, n) in control_cleanup {
                f.counter(&[("worker", "control"), ("step", step.name())], *n as f64);
            }
        },
    );
    family(
        out,
        "ublkd_worker_idle_spin_seconds",
        "How long a worker looks for work in user space before it sleeps (0: it sleeps at once)",
        Kind::Gauge,
        |f| {
            for (w, cpu) in each() {
                f.gauge(&[("worker", cpu)], w.idle_spin.as_secs_f64());
            }
        },
    );
    family(
        out,
        "ublkd_worker_waits_total",
        "Waits for work of a spinning worker, by how they ended: work came while it spun, or it slept",
        Kind::Counter,
        |f| {
            for (w, cpu) in each() {
                for (how, n) in ublkd_dataplane::stats::Wait::ALL.iter().zip(w.waits) {
                    f.counter(&[("worker", cpu), ("how", how.name())], n as f64);
                }
            }
        },
    );
    family(
        out,
        "ublkd_worker_ring_retries_total",
        "Transient io_uring errors (EAGAIN, ENOMEM) a worker waited out",
        Kind::Counter,
        |f| {
            for (w, cpu) in each() {
                f.counter(&[("worker", cpu)], w.ring_retries as f64);
            }
        },
    );
    family(
        out,
        "ublkd_worker_iowq_max_threads",
        "io-wq helper threads a worker may start, by class of work; grows with its queues",
        Kind::Gauge,
        |f| {
            for (w, cpu) in each() {
                for (class, n) in ["bounded", "unbounded"].iter().zip(w.iowq_limits) {
                    f.gauge(&[("worker", cpu), ("class", class)], f64::from(n));
                }
            }
        },
    );
}
