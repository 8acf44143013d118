//! Prometheus metrics. The build, the node and the process are the prometheus crate's
//! registered collectors; the API's calls (`rpcs`), the volumes and the workers (`families`)
//! are written at scrape time from atomic counters and the dataplane's statistics, and the
//! pools' capacity (`pools`) from the same reads GetCapacity makes, so neither
//! the I/O path nor an RPC touches Prometheus. Labels come from bounded sets only (API method,
//! code, volume id, op, state, worker, pool). `text` writes the exposition format into pooled
//! buffers.

mod families;
mod pools;
mod rpcs;
mod text;

use crate::volumes::Volumes;
use prometheus::{IntGaugeVec, Opts, Registry, TextEncoder};
use std::sync::Arc;
use std::time::Duration;

/// What can fail in setting up or writing the metrics.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("registering a collector: {0}")]
    RegisterCollector(#[source] prometheus::Error),
    #[error(transparent)]
    ReadApiMethods(#[from] rpcs::DecodeDescriptors),
    #[error("encoding the registered collectors: {0}")]
    EncodeCollectors(#[source] prometheus::Error),
}

#[derive(Debug, Clone)]
pub struct Metrics {
    /// The build, the node and the process (prometheus's own collector).
    registry: Registry,
    rpcs: Arc<rpcs::Rpcs>,
    buffers: text::Pool,
}

impl Metrics {
    /// Metrics for the node named `node` (empty: the host name).
    pub fn new(node: &str) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let build = IntGaugeVec::new(
            Opts::new("ublkd_build_info", "ublkd build; the value is always 1"),
            &["version"],
        )
        .map_err(MetricsError::RegisterCollector)?;
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let node_info = IntGaugeVec::new(
            Opts::new(
                "ublkd_node_info",
                "The node this ublkd serves, to join its series with node_exporter's by \
                 instance; the value is always 1",
            ),
            &["node"],
        )
        .map_err(MetricsError::RegisterCollector)?;
        let node = if node.is_empty() {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_default()
        } else {
            node.to_owned()
        };
        node_info.with_label_values(&[node.as_str()]).set(1);
        let register = |c: Box<dyn prometheus::core::Collector>| {
            registry
                .register(c)
                .map_err(MetricsError::RegisterCollector)
        };
        register(Box::new(build))?;
        register(Box::new(node_info))?;
        // process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
        register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Self {
            registry,
            rpcs: Arc::new(rpcs::Rpcs::new(ublkd_proto::FILE_DESCRIPTOR_SET)?),
            buffers: text::Pool::default(),
        })
    }

    /// Records one finished RPC.
    pub fn rpc(&self, method: &str, code: tonic::Code, took: Duration) {
        self.rpcs.record(method, code, took);
    }

    /// The text exposition of every metric, volume stats read now, as a response body (whose
    /// buffer serves the next scrape once sent).
    pub async fn render(&self, volumes: &Volumes) -> Result<bytes::Bytes, MetricsError> {
        let mut text = self.buffers.take();
        TextEncoder::new()
            .encode_utf8(&self.registry.gather(), &mut text)
            .map_err(MetricsError::EncodeCollectors)?;
        self.rpcs.write(&mut text);
        let all = volumes.all_stats().await;
        families::write(volumes, &all, &mut text).await;
        let settings = volumes.settings();
        let listed = all.into_iter().map(|(v, _)| v).collect();
        let serving = volumes.dataplane_error().is_none();
        let readings = pools::read(Arc::clone(&settings), listed, serving).await;
        pools::write(&readings, &settings, &mut text);
        Ok(self.buffers.body(text))
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
