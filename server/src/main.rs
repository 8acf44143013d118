//! `ublkd`, the storage-node daemon.
//!
//! What it is: the process that owns the dataplane's workers and exposes volume lifecycle over
//! gRPC (`ublkd.v1`), metrics over HTTP (`/metrics`), configured from file, environment and
//! flags. It keeps a crash-safe registry of volumes and brings them back on start.
//! What it is not: it never touches an io_uring or calls libc for I/O; that is the dataplane's
//! job, reached only through `ublkd_dataplane::Handle`.
// Unsafe code only in the `sys` module, each block with its SAFETY comment.
#![deny(unsafe_code)]

mod authz;
mod backend;
mod capacity;
mod config;
mod convert;
mod devices;
mod error;
mod hooks;
mod metrics;
mod record;
mod registry;
mod rpc_meter;
mod seam;
mod service;
#[cfg(test)]
mod simctx;
mod snapshot;
#[allow(unsafe_code)]
mod sys;
mod tls;
mod validate;
mod volume;
mod volume_id;
mod volumes;
mod windows;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use tokio::sync::watch;
use ublkd_dataplane::{BackendSpec, DeviceSpec, Handle, Toggle};
use ublkd_proto::notation;
use ublkd_proto::v1::{
    self as v1, node_service_server::NodeServiceServer, volume_service_server::VolumeServiceServer,
};

/// Largest request ublkd decodes: volume specs are tiny, anything bigger is refused.
const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// How long a stop waits for the API's connections to end (in-flight calls to finish) before it
/// closes them: a client that keeps one open must not keep ublkd, and its devices, from stopping
/// (found by tests/tests/upgrade.rs, whose own idle connection held the stop for good).
const LISTENER_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(name = "ublkd", version, about = "ublk storage-node daemon")]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Config file (TOML); default /etc/ublkd/ublkd.toml when it exists.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// gRPC listen address, repeatable: unix:///run/ublkd/ublkd.sock or HOST:PORT.
    #[arg(long = "listen")]
    listen: Vec<String>,
    /// Directory of the volume registry.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Directory backing files must resolve under, repeatable.
    #[arg(long = "allowed-root")]
    allowed_roots: Vec<PathBuf>,
    /// Metrics address (HOST:PORT); empty disables.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Worker CPUs, e.g. 0,1.
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<i64>,
    /// text or json.
    #[arg(long)]
    log_format: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the daemon (the default).
    Serve,
    /// Print the ublk features of this kernel.
    Probe,
    /// Serve one volume in the foreground, without gRPC, until SIGINT/SIGTERM.
    Run(Box<RunArgs>),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Size: 1Gi or 1GiB (binary), 1G (decimal); rounded up to whole blocks
    #[arg(long)]
    size: String,
    /// null, ram, file:/PATH, file+create:/PATH, nvme:/dev/ngXnY[@OFFSET[+LEN]]: ublkctl's
    /// notation (`auto` windows need ublkd's registry and are refused here).
    #[arg(long, default_value = "null", value_parser = notation::parse_backend)]
    backend: v1::volume_spec::Backend,
    #[arg(long, default_value_t = 1)]
    queues: u16,
    #[arg(long, default_value_t = 128)]
    depth: u16,
    #[arg(long, default_value_t = 4096)]
    block_size: u32,
    /// auto, batch or per-io.
    #[arg(long, default_value = "auto", value_parser = notation::parse_io_path)]
    io_path: v1::IoPath,
    /// Zero copy: auto, on or off.
    #[arg(long, default_value = "auto")]
    zero_copy: String,
    /// Poll for NVMe completions: auto, on or off.
    #[arg(long, default_value = "auto")]
    poll: String,
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
    /// The worker CPUs are the dataplane's alone, no application submits from them (as
    /// `dataplane.dedicated_cpus`): auto placement spreads there, and auto polling polls.
    #[arg(long)]
    dedicated_cpus: bool,
    /// Which worker serves each queue: auto, same-cpu, other-cpu or spread.
    #[arg(long, value_enum, default_value = "auto")]
    placement: config::QueuePlacementSetting,
    /// Microseconds an idle worker looks for work before sleeping (as
    /// `dataplane.idle_spin_us`; unset: 1000 on dedicated CPUs, else 0).
    #[arg(long)]
    idle_spin_us: Option<u64>,
}

fn parse_toggle(flag: &str, v: &str) -> anyhow::Result<Toggle> {
    validate::toggle_name(v)
        .with_context(|| format!("unknown {flag} {v:?}: expected auto, on or off"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None | Some(Cmd::Serve) => serve(cli.serve),
        Some(Cmd::Probe) => probe(),
        Some(Cmd::Run(args)) => run_one(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ublkd: {e:#}");
            ExitCode::FAILURE
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
    let missing = features.missing(ublkd_dataplane::Features::RECOVERY);
    if missing.0 != 0 {
        anyhow::bail!("the driver lacks {missing}: ublkd serves no volume without user recovery");
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ublkd-rt")
        .enable_all()
        .build()
        .context("starting the runtime")
}

/// Resolves on the first SIGINT or SIGTERM (registered before it is first polled).
fn termination() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// What `ublkd run` serves for `--backend` (read in ublkctl's notation): the dataplane's spec.
/// A `file+create:` file is made or extended to `size`.
fn run_backend(b: &v1::volume_spec::Backend, size: u64) -> anyhow::Result<BackendSpec> {
    if let v1::volume_spec::Backend::File(f) = b {
        if f.create {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&f.path)
                .with_context(|| format!("creating {}", f.path))?;
            if file.metadata()?.len() < size {
                file.set_len(size)
                    .with_context(|| format!("extending {}", f.path))?;
            }
        }
    }
    backend::run_spec(b, size)
        .context("ublkd run has no registry to place an `auto` window in: give its offset")
}

fn run_one(args: RunArgs) -> anyhow::Result<()> {
    // Rounded up to whole blocks, as ublkctl does: `--size 1G` is 10^9 bytes, then some.
    let size = ublkd_proto::units::parse_size(&args.size)
        .and_then(|n| n.checked_next_multiple_of(u64::from(args.block_size.max(1))))
        .with_context(|| format!("bad --size {:?}", args.size))?;
    let backend = run_backend(&args.backend, size)?;
    let io_path = validate::io_path(args.io_path.into()).context("--io-path names no I/O path")?;
    let spec = DeviceSpec {
        size_bytes: size,
        backend,
        queues: args.queues,
        queue_depth: args.depth,
        block_size: args.block_size,
        io_path,
        zero_copy: parse_toggle("--zero-copy", &args.zero_copy)?,
        poll: parse_toggle("--poll", &args.poll)?,
        ..DeviceSpec::default()
    };
    let rt = runtime()?;
    // Listen before announcing READY, so a signal right after it is never lost.
    let stop = rt.block_on(async { termination() })?;
    let handle = Handle::start(ublkd_dataplane::Config {
        cpus: args.cpus,
        placement: args.placement.policy(),
        dedicated_cpus: args.dedicated_cpus,
        idle_spin: args.idle_spin_us.map(std::time::Duration::from_micros),
        ..Default::default()
    })
    .context("starting the dataplane")?;
    let info = handle.add_device(spec).context("creating the volume")?;
    println!("READY {}", info.block_device.display());
    eprintln!(
        "ublkd: serving {} ({} path, zero copy {}, polled {} ({}), queues on {:?} ({:?}: {}), \
         {} queue(s), {} worker(s)); SIGINT/SIGTERM to stop",
        info.block_device.display(),
        info.io_path.name(),
        info.zero_copy,
        info.polled,
        info.poll_reason.describe(),
        info.queue_cpus,
        info.placement,
        info.placement_reason.describe(),
        info.spec.queues,
        handle.worker_count()
    );
    rt.block_on(stop);
    // How each worker's waits ended, for the perf scripts (`tests/perf`). Not being able to
    // read them must not keep the volume from being deleted below.
    match handle.worker_stats() {
        Ok(workers) => {
            for w in workers {
                eprintln!(
                    "ublkd: worker {}: spins up to {} us; waits spun {}, slept {}",
                    w.cpu,
                    w.idle_spin.as_micros(),
                    w.waits[0],
                    w.waits[1]
                );
            }
        }
        Err(e) => eprintln!("ublkd: the workers' counters could not be read: {e}"),
    }
    handle
        .delete_device(info.dev_id)
        .context("deleting the volume")?;
    handle.shutdown().context("stopping the dataplane")?;
    Ok(())
}

fn init_logging(s: &config::Settings) {
    let filter = tracing_subscriber::EnvFilter::try_new(&s.log.level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match s.log.format {
        config::LogFormat::Json => b.json().init(),
        config::LogFormat::Text => b.init(),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut overrides: Vec<(&str, ::config::Value)> = Vec::new();
    if !args.listen.is_empty() {
        overrides.push(("grpc.listen", args.listen.clone().into()));
    }
    if let Some(d) = &args.state_dir {
        overrides.push(("state_dir", d.display().to_string().into()));
    }
    if !args.allowed_roots.is_empty() {
        let roots: Vec<String> = args
            .allowed_roots
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        overrides.push(("allowed_roots", roots.into()));
    }
    if let Some(m) = &args.metrics_listen {
        overrides.push(("metrics.listen", m.clone().into()));
    }
    if !args.cpus.is_empty() {
        overrides.push(("dataplane.cpus", args.cpus.clone().into()));
    }
    if let Some(f) = &args.log_format {
        overrides.push(("log.format", f.clone().into()));
    }
    let mut settings = config::load(args.config.as_deref(), std::env::vars(), &overrides)
        .context("loading the configuration")?;
    init_logging(&settings);
    let limit = capacity::cgroup_memory_limit();
    settings.memory_limit = limit.bytes();
    match limit {
        capacity::MemoryLimit::Bytes(bytes) => tracing::info!(
            limit_bytes = bytes,
            reserve_bytes = capacity::MEMORY_RESERVE,
            "volumes are admitted within the cgroup's memory limit (copy buffers, RAM pages)"
        ),
        capacity::MemoryLimit::Unlimited => {
            tracing::info!("no cgroup memory limit: volumes are admitted by the node's limits only")
        }
        capacity::MemoryLimit::Unknown(why) => tracing::warn!(
            why,
            "the cgroup's memory limit is unknown: volumes are admitted as if there were none, \
             and an OOM kill may stop ublkd if one is enforced"
        ),
    }
    // A test's faults that name nothing would arm nothing and pass: refused at start.
    #[cfg(feature = "test-hooks")]
    if let Ok(spec) = std::env::var(hooks::FAULTS_VAR) {
        hooks::check(&spec).map_err(anyhow::Error::msg)?;
    }
    let rt = runtime()?;
    rt.block_on(daemon(Arc::new(settings)))
}

enum Listen {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

fn parse_listen(s: &str) -> anyhow::Result<Listen> {
    if let Some(p) = s.strip_prefix("unix://") {
        if !p.starts_with('/') {
            bail!("unix listen address {s:?} must be an absolute path (unix:///path)");
        }
        return Ok(Listen::Unix(PathBuf::from(p)));
    }
    let addr = s.strip_prefix("tcp://").unwrap_or(s);
    Ok(Listen::Tcp(addr.parse().with_context(|| {
        format!("listen address {s:?} is neither unix:///path nor HOST:PORT")
    })?))
}

/// The server's overall health ("") and each service's, together.
async fn set_health(health: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    health.set_service_status("", status).await;
    health
        .set_service_status(
            <VolumeServiceServer<service::Api> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
    health
        .set_service_status(
            <NodeServiceServer<service::Api> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// Test hook: on SIGUSR2, the dataplane's faults are armed anew from the file
/// `UBLKD_TEST_FAULTS_FILE` names (`UBLKD_TEST_FAULTS`'s language), so a test can make a running
/// daemon's I/O fail at the moment it chooses and clear the fault again.
#[cfg(feature = "test-hooks")]
fn rearm_faults_on_sigusr2() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let Some(file) = std::env::var_os("UBLKD_TEST_FAULTS_FILE") else {
        return Ok(());
    };
    let mut usr2 = signal(SignalKind::user_defined2())?;
    tokio::spawn(async move {
        while usr2.recv().await.is_some() {
            match std::fs::read_to_string(&file) {
                Ok(spec) => match hooks::check_rearm(&spec) {
                    Ok(()) => {
                        tracing::warn!(faults = %spec.trim(), "test hook: faults armed");
                        ublkd_dataplane::hooks::arm_from_spec(&spec);
                    }
                    Err(e) => tracing::error!(error = %e, "test hook: nothing armed"),
                },
                Err(e) => tracing::error!(error = %e, "test hook: reading the faults file"),
            }
        }
    });
    Ok(())
}

async fn daemon(settings: Arc<config::Settings>) -> anyhow::Result<()> {
    let stop = termination()?;
    #[cfg(feature = "test-hooks")]
    rearm_faults_on_sigusr2()?;
    // The metrics listener (and its /healthz, the kubelet's startup and liveness probe) is bound
    // before anything slow: from here on a probe's connection waits in the backlog until the
    // listener is served, below, instead of being refused while the dataplane starts and the
    // registry loads (a refused probe is a warning event on the pod).
    let metrics_listener = bind_metrics(&settings).await?;
    let registry = record::volume_registry(&settings.state_dir)?;
    let snapshots = registry::Registry::open_dir(settings.state_dir.join("snapshots"))?;
    let intents = registry::Registry::open_dir(settings.state_dir.join("intents"))?;
    let handle = Handle::start(ublkd_dataplane::Config {
        cpus: settings.dataplane.cpus.clone(),
        timeout: std::time::Duration::from_secs(settings.dataplane.control_timeout_secs),
        dedicated_cpus: settings.dataplane.dedicated_cpus,
        placement: settings.dataplane.queue_placement.policy(),
        idle_spin: settings
            .dataplane
            .idle_spin_us
            .map(std::time::Duration::from_micros),
    });
    if let Err(e) = &handle {
        tracing::error!(error = %error::chain(e), "no ublk dataplane: volume calls will fail and the node offers no capacity until a ublk_drv with user recovery is loaded and ublkd restarted");
    }
    let volumes = Arc::new(volumes::Volumes::new(
        handle.map(|h| Arc::new(h) as Arc<dyn devices::Devices>),
        registry,
        snapshots,
        intents,
        Arc::clone(&settings),
    ));
    volumes.load().await?;
    let served = serve_api(&settings, &volumes, metrics_listener, stop).await;
    if served.is_err() {
        // Whatever stopped the daemon (a listener that could not start, one that failed), the
        // dataplane's threads stop before the process exits, as on a clean exit: none of them
        // is still tearing down its rings while the process goes. (`main` prints the error.)
        if let Err(e) = volumes.shutdown().await {
            tracing::warn!(error = %error::chain(&e), "stopping the dataplane");
        }
    }
    served
}

/// The metrics listener `settings.metrics.listen` names, bound; `None` when it names none.
async fn bind_metrics(
    settings: &config::Settings,
) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    if settings.metrics.listen.is_empty() {
        return Ok(None);
    }
    let listener = tokio::net::TcpListener::bind(&settings.metrics.listen)
        .await
        .with_context(|| format!("binding metrics on {}", settings.metrics.listen))?;
    tracing::info!(address = %settings.metrics.listen, "metrics on /metrics");
    Ok(Some(listener))
}

/// Serves the API, and `/metrics` on `metrics_listener`, over `volumes` until `stop` or a
/// listener fails.
async fn serve_api(
    settings: &Arc<config::Settings>,
    volumes: &Arc<volumes::Volumes>,
    metrics_listener: Option<tokio::net::TcpListener>,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let metrics = metrics::Metrics::new(&settings.metrics.node)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        // An error means the sender is gone: the daemon is stopping either way.
        let _ = rx.wait_for(|s| *s).await;
    };

    let mut tasks = tokio::task::JoinSet::new();
    if let Some(listener) = metrics_listener {
        let (m, v) = (metrics.clone(), Arc::clone(volumes));
        let s = stopped(stop_rx.clone());
        tasks.spawn(async move {
            metrics::serve(listener, m, v, s)
                .await
                .map_err(anyhow::Error::from)
        });
    }

    // NOT_SERVING until the start-up restore has finished: a client (the CSI driver, an
    // orchestrator) that sees SERVING may rely on every registered volume having been brought
    // back or marked FAILED with its reason. The API itself answers meanwhile.
    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, false).await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ublkd_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let api = service::Api {
        volumes: Arc::clone(volumes),
        settings: Arc::clone(settings),
    };
    // The certificate and key are read again whenever their files change (tls.rs).
    let tls = match &settings.grpc.tls {
        Some(t) => Some(
            tls::server_config(&t.cert, &t.key, t.client_ca.as_deref())
                .context("setting up TLS for gRPC")?,
        ),
        None => None,
    };
    let mut sockets = Vec::new();
    for addr in &settings.grpc.listen {
        // Counted first, so that a refusal of the role is counted too.
        let mut builder = tonic::transport::Server::builder()
            .layer(rpc_meter::MeterLayer {
                metrics: metrics.clone(),
            })
            .layer(authz::AuthzLayer);
        let router = |b: &mut tonic::transport::Server<rpc_meter::Stack>| {
            b.add_service(health_service.clone())
                .add_service(reflection.clone())
                .add_service(
                    VolumeServiceServer::new(api.clone())
                        .max_decoding_message_size(MAX_MESSAGE_BYTES),
                )
                .add_service(
                    NodeServiceServer::new(api.clone())
                        .max_decoding_message_size(MAX_MESSAGE_BYTES),
                )
        };
        match parse_listen(addr)? {
            Listen::Unix(path) => {
                let listener = bind_unix(&path)?;
                tracing::info!(socket = %path.display(), "gRPC on unix socket");
                sockets.push(path);
                let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
                let r = router(&mut builder);
                let s = stopped(stop_rx.clone());
                tasks.spawn(async move {
                    r.serve_with_incoming_shutdown(incoming, s)
                        .await
                        .map_err(anyhow::Error::from)
                });
            }
            Listen::Tcp(sa) => {
                settings.grpc.check_tcp(sa)?;
                let listener = tokio::net::TcpListener::bind(sa)
                    .await
                    .with_context(|| format!("binding gRPC on {sa}"))?;
                tracing::info!(address = %sa, tls = tls.is_some(), "gRPC on TCP");
                let r = router(&mut builder);
                let s = stopped(stop_rx.clone());
                match &tls {
                    Some(config) => {
                        let incoming = tls::incoming(listener, Arc::clone(config));
                        tasks.spawn(async move {
                            r.serve_with_incoming_shutdown(incoming, s)
                                .await
                                .map_err(anyhow::Error::from)
                        });
                    }
                    None => {
                        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
                        tasks.spawn(async move {
                            r.serve_with_incoming_shutdown(incoming, s)
                                .await
                                .map_err(anyhow::Error::from)
                        });
                    }
                }
            }
        }
    }
    tracing::info!(
        volumes = volumes.list().await.len(),
        "ublkd listening; restoring volumes"
    );
    // A dataplane worker that stops on a fatal error fails its volumes visibly.
    let v = Arc::clone(volumes);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            v.check_workers().await;
            v.check_cleanup().await;
        }
    });
    // Volumes come back while the API already answers (they show as RECOVERING meanwhile).
    let v = Arc::clone(volumes);
    let restored = health.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let mut failed = v.restore().await;
        tracing::info!(
            took_ms = started.elapsed().as_millis() as u64,
            failed = failed.len(),
            "ublkd ready: volumes restored"
        );
        set_health(&restored, true).await;
        // Volumes that could not come back stay FAILED (with the reason) and are retried with
        // a back-off: a takeover that failed half way left its device quiesced, not deleted.
        let mut pause = std::time::Duration::from_secs(1);
        while !failed.is_empty() {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_secs(30));
            failed = v.restore_again(failed).await;
        }
    });

    tokio::select! {
        _ = stop => tracing::info!("stopping: finishing in-flight requests"),
        Some(r) = tasks.join_next() => {
            // No receiver left means no listener left to stop.
            let _ = stop_tx.send(true);
            r.context("server task")??;
            bail!("a listener stopped unexpectedly");
        }
    }
    set_health(&health, false).await;
    // No receiver left means no listener left to stop.
    let _ = stop_tx.send(true);
    // A listener ends once its connections have: one a client keeps open (idle, or unpolled)
    // would hold the stop forever, and the devices with it. In-flight calls get the grace.
    let drained = tokio::time::timeout(LISTENER_GRACE, async {
        while let Some(r) = tasks.join_next().await {
            if let Ok(Err(e)) = r {
                tracing::warn!(error = %e, "listener ended with an error");
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            grace_s = LISTENER_GRACE.as_secs(),
            listeners = tasks.len(),
            "clients still had connections open after the grace: they are closed, and the stop goes on"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    for path in sockets {
        if let Err(e) = std::fs::remove_file(&path) {
            // The next start binds over a stale socket file anyway.
            tracing::warn!(path = %path.display(), error = %e, "socket file not removed");
        }
    }
    volumes.shutdown().await?;
    match settings.on_exit {
        config::OnExit::Keep => {
            tracing::info!("devices kept for the next ublkd; volumes stay registered")
        }
        config::OnExit::Delete => {
            tracing::info!("devices removed; volumes stay registered for the next start")
        }
    }
    Ok(())
}

fn bind_unix(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("{} exists and is not a socket", path.display());
        }
        // A socket left by a previous ublkd: refuse if something still answers on it.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("another ublkd is listening on {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
