//! `ublkctl`, the command-line client of ublkd.
//!
//! What it is: subcommands (`create-volume`, `list-volumes`, `stats`, `adopt-device`, ...) that
//! each make one call of the `ublkd.v1` gRPC API to a running daemon, over its unix socket or
//! over TCP with optional (mutual) TLS, and print the reply as text or JSON.
//! What it is not: it depends on the proto crate only, never on the dataplane or the server; it
//! never touches a device itself and keeps no state between runs. It validates only what the
//! command line can check (sizes, backend syntax, option combinations); the daemon decides the
//! rest.
//!
//! Exit codes: 0 success, 1 the daemon answered with an error, 2 a usage error, 3 the daemon
//! cannot be reached (not running, or a certificate refused by either side of TLS).
//!
//! Modules: `args` (clap definitions and request building), `qos` (the I/O limit flags and
//! `set-qos`'s merge), `snapshot` (the snapshot commands and clone sources), `output` (text and
//! JSON rendering), `profiles` (named nodes), `error` (messages and exit codes); `fake_daemon`
//! holds the tests that run whole commands against an in-process fake ublkd.
#![forbid(unsafe_code)]

mod api_json;
mod args;
mod error;
#[cfg(test)]
mod fake_daemon;
mod output;
mod profiles;
mod qos;
mod snapshot;
mod writer;

use std::future::Future;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use ublkd_proto::v1::{
    node_service_client::NodeServiceClient, volume_service_client::VolumeServiceClient,
    DeleteVolumeRequest, GetCapacityRequest, GetNodeInfoRequest, GetVolumeRequest,
    GetVolumeStatsRequest, ListVolumesRequest,
};

use crate::args::{delete_orphan_request, resize_request, Call, Cli, Command, Format};
use crate::error::Error;
use crate::snapshot::SnapshotCall;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let call = match &cli.command {
        Command::Call(call) => call,
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "ublkctl", &mut script);
            return emit(&script);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(&cli, call)) {
        Ok(mut text) => {
            text.push('\n');
            emit(text.as_bytes())
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Writes to stdout; a reader that went away (`ublkctl ... | head`) is not an error.
fn emit(bytes: &[u8]) -> ExitCode {
    let mut stdout = io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write the output: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One connected daemon and the deadline every call gets.
#[derive(Debug)]
struct Client {
    channel: Channel,
    endpoint: String,
    timeout: Duration,
}

impl Client {
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// Awaits one call. The deadline travels to the server as `grpc-timeout`, and tonic's
    /// channel enforces it locally too; the outer timer is a backstop should either not fire.
    async fn call<T>(
        &self,
        call: impl Future<Output = Result<Response<T>, Status>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(Error::from_status(status, &self.endpoint, self.timeout)),
            Err(_) => Err(Error::no_reply(&self.endpoint, self.timeout)),
        }
    }

    fn volumes(&self) -> VolumeServiceClient<Channel> {
        VolumeServiceClient::new(self.channel.clone())
    }

    fn node(&self) -> NodeServiceClient<Channel> {
        NodeServiceClient::new(self.channel.clone())
    }
}

/// Makes the call and returns what to print.
async fn execute(cli: &Cli, call: &Call) -> Result<String, Error> {
    let conn = cli.connection()?;
    let client = Client {
        channel: ublkd_client::connect(&conn).await?,
        endpoint: conn.target.to_string(),
        timeout: conn.timeout,
    };
    let json = cli.output != Format::Text;
    let text = match call {
        Call::CreateVolume(create) => {
            let request = client.request(create.to_request());
            let volume = client.call(client.volumes().create_volume(request)).await?;
            if json {
                api_json::pretty(&volume, "Volume")?
            } else {
                output::device_line(&volume)
            }
        }
        Call::DeleteVolume {
            name,
            allow_missing,
            delete_backing,
            force,
        } => {
            let request = client.request(DeleteVolumeRequest {
                id: name.clone(),
                allow_missing: *allow_missing,
                delete_backing: *delete_backing,
                force: *force,
            });
            client.call(client.volumes().delete_volume(request)).await?;
            if json {
                "{}".into()
            } else {
                format!("deleted volume {name:?}")
            }
        }
        Call::GetVolume { name } => {
            let request = client.request(GetVolumeRequest { id: name.clone() });
            let volume = client.call(client.volumes().get_volume(request)).await?;
            if json {
                api_json::pretty(&volume, "Volume")?
            } else {
                output::volume_text(&volume)
            }
        }
        Call::ListVolumes => {
            let request = client.request(ListVolumesRequest {});
            let list = client.call(client.volumes().list_volumes(request)).await?;
            if json {
                api_json::pretty(&list, "ListVolumesResponse")?
            } else {
                output::volumes_table(&list.volumes, !cli.no_headers)
            }
        }
        Call::ResizeVolume { name, size } => {
            let request = client.request(resize_request(name, *size));
            let volume = client.call(client.volumes().resize_volume(request)).await?;
            if json {
                api_json::pretty(&volume, "Volume")?
            } else {
                output::volume_text(&volume)
            }
        }
        Call::SetQos(set) => {
            // The API replaces the whole set: read it, change what the flags name, send it back.
            let request = client.request(GetVolumeRequest {
                id: set.name.clone(),
            });
            let volume = client.call(client.volumes().get_volume(request)).await?;
            let current = volume.spec.and_then(|s| s.qos);
            let request = client.request(set.to_request(current));
            let volume = client
                .call(client.volumes().set_volume_qos(request))
                .await?;
            if json {
                api_json::pretty(&volume, "Volume")?
            } else {
                output::volume_text(&volume)
            }
        }
        Call::Snapshot(SnapshotCall::CreateSnapshot { id, volume }) => {
            let request = client.request(snapshot::create_request(id, volume));
            let snap = client
                .call(client.volumes().create_snapshot(request))
                .await?;
            if json {
                api_json::pretty(&snap, "Snapshot")?
            } else {
                snapshot::snapshot_text(&snap)
            }
        }
        Call::Snapshot(SnapshotCall::DeleteSnapshot { id, allow_missing }) => {
            let request = client.request(snapshot::delete_request(id, *allow_missing));
            client
                .call(client.volumes().delete_snapshot(request))
                .await?;
            if json {
                "{}".into()
            } else {
                format!("deleted snapshot {id:?}")
            }
        }
        Call::Snapshot(SnapshotCall::ListSnapshots { volume }) => {
            let request = client.request(snapshot::list_request(volume.as_deref()));
            let list = client
                .call(client.volumes().list_snapshots(request))
                .await?;
            if json {
                api_json::pretty(&list, "ListSnapshotsResponse")?
            } else {
                snapshot::snapshots_table(&list.snapshots, !cli.no_headers)
            }
        }
        Call::Capacity { backend } => {
            let request = client.request(GetCapacityRequest {
                backend: Some(backend.clone()),
            });
            let cap = client.call(client.node().get_capacity(request)).await?;
            if json {
                api_json::pretty(&cap, "Capacity")?
            } else {
                output::capacity_text(&cap)
            }
        }
        Call::NodeInfo { ready } => {
            let request = client.request(GetNodeInfoRequest {});
            let info = client.call(client.node().get_node_info(request)).await?;
            if *ready && !info.dataplane_error.is_empty() {
                return Err(Error::NotReady(info.dataplane_error));
            }
            if json {
                api_json::pretty(&info, "NodeInfo")?
            } else {
                output::node_text(&info)
            }
        }
        Call::Orphans => {
            let request = client.request(GetNodeInfoRequest {});
            let info = client.call(client.node().get_node_info(request)).await?;
            if json {
                output::orphans_json(&info.orphans, &info.volumes_without_pv)
            } else {
                output::orphans_table(&info.orphans, &info.volumes_without_pv, !cli.no_headers)
            }
        }
        Call::AdoptDevice(adopt) => {
            let request = client.request(adopt.to_request());
            let volume = client.call(client.node().adopt_device(request)).await?;
            if json {
                api_json::pretty(&volume, "Volume")?
            } else {
                output::device_line(&volume)
            }
        }
        Call::DeleteOrphan { dev_id } => {
            let request = client.request(delete_orphan_request(*dev_id));
            client.call(client.node().delete_orphan(request)).await?;
            if json {
                "{}".into()
            } else {
                format!("deleted orphan ublk device {dev_id}")
            }
        }
        Call::Stats { name } => {
            let request = client.request(GetVolumeStatsRequest { id: name.clone() });
            let stats = client
                .call(client.volumes().get_volume_stats(request))
                .await?;
            if json {
                api_json::pretty(&stats, "VolumeStats")?
            } else {
                output::stats_text(&stats)
            }
        }
    };
    Ok(if cli.output == Format::Yaml {
        writer::json_to_yaml(&text)
    } else {
        text
    })
}
