//! `ublkd`, the storage-node daemon.
//!
//! What it is: the process that owns the dataplane's workers and exposes volume lifecycle over
//! gRPC, metrics over HTTP and configuration from file and environment.
//! What it is not: it never touches an io_uring or calls libc for I/O; that is the dataplane's job.
//!
//! Today it answers `ublkd probe` (what the kernel offers) and `ublkd run` (serve one volume in
//! the foreground until SIGINT/SIGTERM). The gRPC service arrives with the control-plane work.

use anyhow::{bail, Context};
use std::path::PathBuf;
use std::process::ExitCode;
use ublkd_dataplane::{BackendSpec, Config, DeviceSpec, Handle, IoPath};

const USAGE: &str = "\
usage:
  ublkd probe
      print the ublk features of this kernel
  ublkd run --size SIZE [--backend null|ram|file:PATH] [--queues N] [--depth N]
            [--io-path auto|batch|per-io] [--block-size 512|4096] [--cpus 0,1,...]
      serve one volume in the foreground; prints `READY /dev/ublkbN` once it serves I/O,
      deletes it on SIGINT/SIGTERM
  ublkd --version";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("probe") => probe(),
        Some("run") => run(&args[1..]),
        Some("--version") | Some("-V") => {
            println!("ublkd {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Some("--help") | Some("-h") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
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
    Ok(())
}

fn parse_backend(s: &str) -> anyhow::Result<BackendSpec> {
    Ok(match s {
        "null" => BackendSpec::Null,
        "ram" => BackendSpec::Ram,
        other => match other.strip_prefix("file:") {
            Some(p) if !p.is_empty() => BackendSpec::File {
                path: PathBuf::from(p),
            },
            _ => bail!("unknown backend {other:?}: expected null, ram or file:PATH"),
        },
    })
}

fn run(args: &[String]) -> anyhow::Result<()> {
    let mut spec = DeviceSpec::default();
    let mut size = None;
    let mut cpus = Vec::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .with_context(|| format!("{flag} needs a value"))
                .map(String::as_str)
        };
        match flag.as_str() {
            "--size" => {
                let v = value()?;
                size = Some(
                    ublkd_proto::units::parse_size(v).with_context(|| format!("bad size {v:?}"))?,
                );
            }
            "--backend" => spec.backend = parse_backend(value()?)?,
            "--queues" => spec.queues = value()?.parse().context("bad --queues")?,
            "--depth" => spec.queue_depth = value()?.parse().context("bad --depth")?,
            "--block-size" => spec.block_size = value()?.parse().context("bad --block-size")?,
            "--io-path" => {
                spec.io_path = match value()? {
                    "auto" => IoPath::Auto,
                    "batch" => IoPath::Batch,
                    "per-io" | "per_io" => IoPath::PerIo,
                    other => bail!("unknown --io-path {other:?}: expected auto, batch or per-io"),
                }
            }
            "--cpus" => {
                cpus = value()?
                    .split(',')
                    .map(|c| c.trim().parse().context("bad --cpus"))
                    .collect::<anyhow::Result<_>>()?
            }
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    spec.size_bytes = size.context("--size is required")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // Listen before announcing READY, so a signal right after it is never lost.
    let (mut term, mut int) = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        anyhow::Ok((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    })?;
    let handle = Handle::start(Config {
        cpus,
        ..Config::default()
    })
    .context("starting the dataplane")?;
    let info = handle.add_device(spec).context("creating the volume")?;
    println!("READY {}", info.block_device.display());
    eprintln!(
        "ublkd: serving {} ({} path, {} queue(s), {} worker(s)); SIGINT/SIGTERM to stop",
        info.block_device.display(),
        info.io_path.name(),
        info.spec.queues,
        handle.worker_count()
    );
    rt.block_on(async {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    });
    handle
        .delete_device(info.dev_id)
        .context("deleting the volume")?;
    handle.shutdown().context("stopping the dataplane")?;
    Ok(())
}
