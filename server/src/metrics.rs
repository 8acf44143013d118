//! Prometheus metrics. gRPC and build metrics are ordinary registered collectors; volume and
//! worker metrics are built at scrape time from the dataplane's statistics, so the I/O path
//! never touches Prometheus. Labels come from bounded sets only (volume id, op, state, worker).

use crate::volumes::{State, Volumes};
use prometheus::proto::MetricType;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};
use std::sync::Arc;
use std::time::Duration;
use ublkd_dataplane::stats::{BATCH_BOUNDS, LATENCY_BOUNDS};
use ublkd_dataplane::OpKind;

#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    grpc_requests: IntCounterVec,
    grpc_duration: HistogramVec,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let grpc_requests = IntCounterVec::new(
            Opts::new(
                "ublkd_grpc_requests_total",
                "gRPC requests by method and status code",
            ),
            &["method", "code"],
        )?;
        let grpc_duration = HistogramVec::new(
            HistogramOpts::new(
                "ublkd_grpc_request_duration_seconds",
                "gRPC request handling time by method",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0,
            ]),
            &["method"],
        )?;
        let build = prometheus::IntGaugeVec::new(
            Opts::new("ublkd_build_info", "ublkd build; the value is always 1"),
            &["version"],
        )?;
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        registry.register(Box::new(grpc_requests.clone()))?;
        registry.register(Box::new(grpc_duration.clone()))?;
        registry.register(Box::new(build))?;
        Ok(Self {
            registry,
            grpc_requests,
            grpc_duration,
        })
    }

    /// Records one finished RPC.
    pub fn rpc(&self, method: &str, code: tonic::Code, took: Duration) {
        self.grpc_requests
            .with_label_values(&[method, code_name(code)])
            .inc();
        self.grpc_duration
            .with_label_values(&[method])
            .observe(took.as_secs_f64());
    }

    /// The text exposition of every metric, volume stats read now.
    pub async fn render(&self, volumes: &Volumes) -> String {
        let mut out = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .is_err()
        {
            return String::new();
        }
        let mut text = String::from_utf8(out).unwrap_or_default();
        volume_families(volumes, &mut text).await;
        text
    }
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// One metric family, written straight in the text exposition format as samples are added
/// (no per-sample objects: a scrape with hundreds of volumes stays a few string appends each).
struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    samples: String,
}

impl Family {
    fn new(name: &'static str, help: &'static str, kind: MetricType) -> Self {
        let kind = match kind {
            MetricType::COUNTER => "counter",
            MetricType::HISTOGRAM => "histogram",
            _ => "gauge",
        };
        Self {
            name,
            help,
            kind,
            samples: String::new(),
        }
    }

    /// One sample line: `name{labels,extra} value`.
    fn line(&mut self, suffix: &str, labels: &[(&str, &str)], extra: Option<(&str, &str)>, v: f64) {
        let out = &mut self.samples;
        out.push_str(self.name);
        out.push_str(suffix);
        let all = labels.iter().copied().chain(extra);
        let mut first = true;
        for (k, val) in all {
            out.push(if first { '{' } else { ',' });
            first = false;
            out.push_str(k);
            out.push_str("=\"");
            for c in val.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        if !first {
            out.push('}');
        }
        out.push(' ');
        push_value(out, v);
        out.push('\n');
    }

    fn counter(&mut self, labels: &[(&str, &str)], v: f64) {
        self.line("", labels, None, v);
    }

    fn gauge(&mut self, labels: &[(&str, &str)], v: f64) {
        self.line("", labels, None, v);
    }

    /// A histogram from non-cumulative `counts` (one per bound, then +Inf).
    fn histogram(&mut self, labels: &[(&str, &str)], bounds: &[f64], counts: &[u64], sum: f64) {
        let mut acc = 0u64;
        let mut le = String::new();
        for (i, ub) in bounds.iter().enumerate() {
            acc += counts.get(i).copied().unwrap_or(0);
            le.clear();
            push_value(&mut le, *ub);
            self.line("_bucket", labels, Some(("le", &le)), acc as f64);
        }
        let total = acc + counts.iter().skip(bounds.len()).sum::<u64>();
        self.line("_bucket", labels, Some(("le", "+Inf")), total as f64);
        self.line("_sum", labels, None, sum);
        self.line("_count", labels, None, total as f64);
    }

    /// The family in the text format; nothing when it has no sample.
    fn write(&self, out: &mut String) {
        if self.samples.is_empty() {
            return;
        }
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        out.push_str(&self.samples);
    }
}

/// A sample value as Prometheus reads it (`+Inf`, `-Inf`, `NaN`, else Rust's shortest form).
fn push_value(out: &mut String, v: f64) {
    use std::fmt::Write;
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{v}");
    }
}

async fn volume_families(volumes: &Volumes, out: &mut String) {
    use MetricType::{COUNTER, GAUGE, HISTOGRAM};
    let mut ops = Family::new(
        "ublkd_volume_io_ops_total",
        "I/O requests completed",
        COUNTER,
    );
    let mut bytes = Family::new(
        "ublkd_volume_io_bytes_total",
        "Bytes moved by completed I/O",
        COUNTER,
    );
    let mut errors = Family::new(
        "ublkd_volume_io_errors_total",
        "I/O requests failed",
        COUNTER,
    );
    let mut protocol = Family::new(
        "ublkd_volume_protocol_errors_total",
        "ublk commands that failed unexpectedly; each stops a queue",
        COUNTER,
    );
    let mut retries = Family::new(
        "ublkd_volume_io_retries_total",
        "Backend operations sent again after a passing failure (NVMe path errors, resets)",
        COUNTER,
    );
    let mut duration = Family::new(
        "ublkd_volume_io_duration_seconds",
        "Time from the request reaching ublkd to its completion",
        HISTOGRAM,
    );
    let mut inflight = Family::new("ublkd_volume_inflight_ios", "I/O requests in flight", GAUGE);
    let mut size = Family::new("ublkd_volume_size_bytes", "Volume capacity", GAUGE);
    let mut memory = Family::new(
        "ublkd_volume_memory_bytes",
        "Memory held by the backend",
        GAUGE,
    );
    let mut state = Family::new(
        "ublkd_volume_state",
        "1 for the volume's current state",
        GAUGE,
    );
    let mut info = Family::new("ublkd_volume_info", "Volume attributes; always 1", GAUGE);
    let mut batch = Family::new(
        "ublkd_worker_batch_size",
        "Requests started per worker loop iteration",
        HISTOGRAM,
    );
    let mut busy = Family::new(
        "ublkd_worker_busy_seconds_total",
        "Time workers spent handling completions",
        COUNTER,
    );
    let mut worker_up = Family::new(
        "ublkd_worker_up",
        "1 while the worker serves; 0 once a fatal ring error stopped it",
        GAUGE,
    );
    let mut ring_retries = Family::new(
        "ublkd_worker_ring_retries_total",
        "Transient io_uring errors (EAGAIN, ENOMEM) a worker waited out",
        COUNTER,
    );
    let mut iowq = Family::new(
        "ublkd_worker_iowq_max_threads",
        "io-wq helper threads a worker may start, by class of work; grows with its queues",
        GAUGE,
    );
    let mut count = Family::new("ublkd_volumes", "Volumes known to this node", GAUGE);
    let mut recoveries = Family::new(
        "ublkd_volume_recoveries_total",
        "Kernel devices taken over from a previous ublkd (after a crash or an upgrade)",
        COUNTER,
    );
    let mut recovery_duration = Family::new(
        "ublkd_volume_recovery_duration_seconds",
        "Time to take over one device: start of recovery to I/O flowing",
        HISTOGRAM,
    );
    let mut orphans = Family::new(
        "ublkd_orphan_devices",
        "ublk devices in the kernel that no registered volume owns",
        GAUGE,
    );
    let r = &volumes.recoveries;
    recoveries.counter(
        &[],
        r.total.load(std::sync::atomic::Ordering::Relaxed) as f64,
    );
    let counts: Vec<u64> = r
        .buckets
        .iter()
        .map(|b| b.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    recovery_duration.histogram(
        &[],
        &crate::volumes::RECOVERY_BOUNDS,
        &counts,
        r.sum_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9,
    );
    orphans.gauge(&[], volumes.orphans().await.len() as f64);
    let all = volumes.all_stats().await;
    count.gauge(&[], all.len() as f64);
    for (vol, stats) in &all {
        let id = vol.record.id.as_str();
        let l = [("volume", id)];
        size.gauge(&l, vol.record.size_bytes as f64);
        for s in State::ALL {
            state.gauge(
                &[("volume", id), ("state", s.name())],
                f64::from(u8::from(s == vol.state)),
            );
        }
        let backend = match &vol.record.backend {
            crate::registry::BackendRecord::Null => "null",
            crate::registry::BackendRecord::Ram => "ram",
            crate::registry::BackendRecord::File { .. } => "file",
            crate::registry::BackendRecord::Nvme { .. } => "nvme",
        };
        let device = vol
            .device
            .as_ref()
            .map(|d| d.block_device.display().to_string())
            .unwrap_or_default();
        let io_path = vol.device.as_ref().map_or("", |d| d.io_path.name());
        let on_off = |b: bool| if b { "on" } else { "off" };
        let zero_copy = vol
            .device
            .as_ref()
            .map_or("", |d| on_off(d.zero_copy_in_use()));
        let polled = vol.device.as_ref().map_or("", |d| on_off(d.polled));
        info.gauge(
            &[
                ("volume", id),
                ("backend", backend),
                ("device", device.as_str()),
                ("io_path", io_path),
                ("zero_copy", zero_copy),
                ("poll", polled),
            ],
            1.0,
        );
        let Some(st) = stats else { continue };
        for op in OpKind::ALL {
            let l = [("volume", id), ("op", op.name())];
            ops.counter(&l, st.total.ops_of(op) as f64);
            bytes.counter(&l, st.total.bytes_of(op) as f64);
        }
        errors.counter(&l, st.total.errors as f64);
        protocol.counter(&l, st.total.protocol_errors as f64);
        retries.counter(&l, st.total.retries as f64);
        inflight.gauge(&l, st.total.inflight as f64);
        memory.gauge(&l, st.memory_bytes as f64);
        duration.histogram(
            &l,
            &LATENCY_BOUNDS,
            &st.total.latency_buckets,
            st.total.latency_sum_ns as f64 / 1e9,
        );
    }
    let bounds: Vec<f64> = BATCH_BOUNDS.iter().map(|&b| b as f64).collect();
    for w in volumes.workers().await {
        let cpu = w.cpu.to_string();
        let l = [("worker", cpu.as_str())];
        busy.counter(&l, w.busy_seconds);
        worker_up.gauge(&l, if w.down_errno.is_none() { 1.0 } else { 0.0 });
        ring_retries.counter(&l, w.ring_retries as f64);
        for (class, n) in ["bounded", "unbounded"].iter().zip(w.iowq_limits) {
            iowq.gauge(&[("worker", cpu.as_str()), ("class", class)], f64::from(n));
        }
        batch.histogram(&l, &bounds, &w.batch_buckets, w.batch_sum as f64);
    }
    [
        ops,
        bytes,
        errors,
        protocol,
        retries,
        duration,
        inflight,
        size,
        memory,
        state,
        info,
        batch,
        busy,
        worker_up,
        ring_retries,
        iowq,
        count,
        recoveries,
        recovery_duration,
        orphans,
    ]
    .iter()
    .for_each(|f| f.write(out));
}

/// Serves `/metrics` (and `/healthz`) on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    volumes: Arc<Volumes>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                let volumes = Arc::clone(&volumes);
                async move {
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        metrics.render(&volumes).await,
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let mut g = Family::new("ublkd_x", "An x", MetricType::GAUGE);
        g.gauge(&[("volume", "a\"b"), ("op", "read")], 1.5);
        let mut h = Family::new("ublkd_h_seconds", "An h", MetricType::HISTOGRAM);
        h.histogram(&[("volume", "v")], &[0.5, 1.0], &[1, 2, 3], 4.25);
        let empty = Family::new("ublkd_none", "Nothing", MetricType::COUNTER);
        let mut out = String::new();
        for f in [&g, &h, &empty] {
            f.write(&mut out);
        }
        assert_eq!(
            out,
            "# HELP ublkd_x An x\n# TYPE ublkd_x gauge\n\
             ublkd_x{volume=\"a\\\"b\",op=\"read\"} 1.5\n\
             # HELP ublkd_h_seconds An h\n# TYPE ublkd_h_seconds histogram\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"0.5\"} 1\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"1\"} 3\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"+Inf\"} 6\n\
             ublkd_h_seconds_sum{volume=\"v\"} 4.25\n\
             ublkd_h_seconds_count{volume=\"v\"} 6\n"
        );
    }
}
