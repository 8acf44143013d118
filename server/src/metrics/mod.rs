//! Prometheus metrics. gRPC and build metrics are ordinary registered collectors; volume and
//! worker metrics are built at scrape time from the dataplane's statistics, so the I/O path
//! never touches Prometheus. Labels come from bounded sets only (volume id, op, state, worker).
//! `text` writes the exposition format into pooled buffers; `families` writes the volume and
//! worker families.

mod families;
mod text;

use crate::volumes::Volumes;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    grpc_requests: IntCounterVec,
    grpc_duration: HistogramVec,
    buffers: text::Pool,
}

impl Metrics {
    /// Metrics for the node named `node` (empty: the host name).
    pub fn new(node: &str) -> Result<Self, prometheus::Error> {
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
        let node_info = prometheus::IntGaugeVec::new(
            Opts::new(
                "ublkd_node_info",
                "The node this ublkd serves, to join its series with node_exporter's by \
                 instance; the value is always 1",
            ),
            &["node"],
        )?;
        let node = if node.is_empty() {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default()
        } else {
            node.to_owned()
        };
        node_info.with_label_values(&[node.as_str()]).set(1);
        registry.register(Box::new(grpc_requests.clone()))?;
        registry.register(Box::new(grpc_duration.clone()))?;
        registry.register(Box::new(build))?;
        registry.register(Box::new(node_info))?;
        // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Self {
            registry,
            grpc_requests,
            grpc_duration,
            buffers: text::Pool::default(),
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

    /// The text exposition of every metric, volume stats read now, as a response body (whose
    /// buffer serves the next scrape once sent).
    pub async fn render(&self, volumes: &Volumes) -> Result<bytes::Bytes, prometheus::Error> {
        let mut text = self.buffers.take();
        TextEncoder::new().encode_utf8(&self.registry.gather(), &mut text)?;
        families::write(volumes, &mut text).await;
        Ok(self.buffers.body(text))
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
                    use axum::http::StatusCode;
                    use axum::response::IntoResponse;
                    match metrics.render(&volumes).await {
                        Ok(body) => {
                            ([("content-type", "text/plain; version=0.0.4")], body).into_response()
                        }
                        // Never an empty 200: Prometheus would take it for "no series".
                        Err(e) => {
                            tracing::error!(error = %e, "encoding metrics failed");
                            (
                                StatusCode::INTERNAL_SERVER_ERROR,
                                format!("encoding metrics failed: {e}\n"),
                            )
                                .into_response()
                        }
                    }
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}
