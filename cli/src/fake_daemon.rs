//! Tests of whole commands against an in-process fake ublkd on a unix socket: the real channel,
//! deadline header, status mapping and rendering, with no daemon needed.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use clap::Parser;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use ublkd_proto::v1::node_service_server::{NodeService, NodeServiceServer};
use ublkd_proto::v1::volume_service_server::{VolumeService, VolumeServiceServer};
use ublkd_proto::v1::{
    get_capacity_request,
    volume_spec::{Backend, Source},
    AdoptDeviceRequest, Capacity, CreateSnapshotRequest, CreateVolumeRequest, DeleteOrphanRequest,
    DeleteOrphanResponse, DeleteSnapshotRequest, DeleteSnapshotResponse, DeleteVolumeRequest,
    DeleteVolumeResponse, Extent, GetCapacityRequest, GetNodeInfoRequest, GetVolumeRequest,
    GetVolumeStatsRequest, IoPath, ListSnapshotsRequest, ListSnapshotsResponse, ListVolumesRequest,
    ListVolumesResponse, NodeInfo, OpStats, OrphanDevice, QosLimits, RamBackend,
    ResizeVolumeRequest, SetVolumeQosRequest, Snapshot, Volume, VolumeSpec, VolumeState,
    VolumeStats,
};

use crate::args::{Cli, Command};
use crate::execute;

mod qos_and_snapshots;

/// Holds at most one volume (the last created or adopted), the orphan ublk devices it was
/// given and the snapshots taken; remembers what the client sent.
#[derive(Debug, Default)]
struct Fake {
    volume: Mutex<Option<Volume>>,
    orphans: Mutex<Vec<OrphanDevice>>,
    snapshots: Mutex<Vec<Snapshot>>,
    /// The last `SetVolumeQos` request.
    qos_set: Mutex<Option<SetVolumeQosRequest>>,
    /// The `grpc-timeout` header of the last request.
    deadline_header: Mutex<Option<String>>,
    /// The last `AdoptDevice` request.
    adopted: Mutex<Option<AdoptDeviceRequest>>,
    /// What NodeInfo says of the dataplane (empty: it runs).
    dataplane_error: Mutex<String>,
}

impl Fake {
    fn saw<T>(&self, request: &Request<T>) {
        *self.deadline_header.lock().unwrap() = request
            .metadata()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
    }

    fn find(&self, id: &str) -> Result<Volume, Status> {
        self.volume
            .lock()
            .unwrap()
            .clone()
            .filter(|v| v.id == id)
            .ok_or_else(|| Status::not_found(format!("volume {id:?} does not exist")))
    }

    /// A new volume's source must exist, and the volume be at least its size.
    fn check_source(&self, spec: &VolumeSpec) -> Result<(), Status> {
        let source_size = match &spec.source {
            None => return Ok(()),
            Some(Source::FromVolume(id)) => self.find(id)?.spec.unwrap_or_default().size_bytes,
            Some(Source::FromSnapshot(id)) => {
                self.snapshots
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|s| s.id == *id)
                    .ok_or_else(|| Status::not_found(format!("snapshot {id:?} does not exist")))?
                    .size_bytes
            }
        };
        if spec.size_bytes < source_size {
            return Err(Status::invalid_argument(format!(
                "size_bytes {} is less than the source's {source_size}",
                spec.size_bytes
            )));
        }
        Ok(())
    }
}

/// Limits as the daemon keeps them: the burst checked, and no limits at all reported as unset.
fn stored_qos(qos: Option<QosLimits>) -> Result<Option<QosLimits>, Status> {
    match qos {
        Some(q) if q.burst_ms > 60_000 => Err(Status::invalid_argument(format!(
            "qos burst_ms {} must be at most 60000",
            q.burst_ms
        ))),
        Some(q) if q == QosLimits::default() => Ok(None),
        q => Ok(q),
    }
}

#[tonic::async_trait]
impl VolumeService for Fake {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<Volume>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        let mut spec = request.spec.unwrap_or_default();
        self.check_source(&spec)?;
        spec.qos = stored_qos(spec.qos)?;
        let volume = Volume {
            id: request.id,
            spec: Some(spec),
            state: VolumeState::Ready.into(),
            device_path: "/dev/ublkb0".into(),
            io_path_in_use: IoPath::Batch.into(),
            ..Volume::default()
        };
        *self.volume.lock().unwrap() = Some(volume.clone());
        Ok(Response::new(volume))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        if !request.allow_missing {
            self.find(&request.id)?;
        }
        self.volume.lock().unwrap().take();
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn get_volume(
        &self,
        request: Request<GetVolumeRequest>,
    ) -> Result<Response<Volume>, Status> {
        self.saw(&request);
        self.find(&request.into_inner().id).map(Response::new)
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        self.saw(&request);
        let volumes = self.volume.lock().unwrap().clone().into_iter().collect();
        Ok(Response::new(ListVolumesResponse { volumes }))
    }

    async fn resize_volume(
        &self,
        request: Request<ResizeVolumeRequest>,
    ) -> Result<Response<Volume>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        let mut volume = self.find(&request.id)?;
        let spec = volume.spec.get_or_insert_with(Default::default);
        if request.size_bytes < spec.size_bytes {
            return Err(Status::failed_precondition("volumes only grow"));
        }
        spec.size_bytes = request.size_bytes;
        *self.volume.lock().unwrap() = Some(volume.clone());
        Ok(Response::new(volume))
    }

    async fn get_volume_stats(
        &self,
        request: Request<GetVolumeStatsRequest>,
    ) -> Result<Response<VolumeStats>, Status> {
        self.saw(&request);
        let volume = self.find(&request.into_inner().id)?;
        // Only a volume with limits is ever held back.
        let limited = volume.spec.as_ref().is_some_and(|s| s.qos.is_some());
        Ok(Response::new(VolumeStats {
            throttled_requests: if limited { 3 } else { 0 },
            throttled_seconds: if limited { 0.25 } else { 0.0 },
            id: volume.id,
            ops: vec![OpStats {
                op: "write".into(),
                count: 2,
                bytes: 8192,
                latency_p50_seconds: 0.0015,
                latency_p99_seconds: 0.004,
            }],
            latency_mean_seconds: 0.002,
            ..VolumeStats::default()
        }))
    }

    /// Replaces the whole set, as the daemon does.
    async fn set_volume_qos(
        &self,
        request: Request<SetVolumeQosRequest>,
    ) -> Result<Response<Volume>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        *self.qos_set.lock().unwrap() = Some(request.clone());
        let mut volume = self.find(&request.id)?;
        volume.spec.get_or_insert_with(Default::default).qos = stored_qos(request.qos)?;
        *self.volume.lock().unwrap() = Some(volume.clone());
        Ok(Response::new(volume))
    }

    /// File volumes only; idempotent by id. The copy's path is the backing file's plus
    /// `.snap-ID`.
    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<Snapshot>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        let volume = self.find(&request.source_volume_id)?;
        let spec = volume.spec.unwrap_or_default();
        let Some(Backend::File(file)) = &spec.backend else {
            return Err(Status::failed_precondition(format!(
                "volume {:?} is not a file volume",
                volume.id
            )));
        };
        let mut snapshots = self.snapshots.lock().unwrap();
        if let Some(existing) = snapshots.iter().find(|s| s.id == request.id) {
            if existing.source_volume_id != volume.id {
                return Err(Status::already_exists(format!(
                    "snapshot {:?} is of volume {:?}",
                    existing.id, existing.source_volume_id
                )));
            }
            return Ok(Response::new(existing.clone()));
        }
        let mut snapshot = Snapshot {
            path: format!("{}.snap-{}", file.path, request.id),
            id: request.id,
            source_volume_id: volume.id,
            size_bytes: spec.size_bytes,
            created: None,
            ready: true,
        };
        let taken = i64::try_from(snapshots.len()).unwrap();
        snapshot
            .created
            .get_or_insert_with(Default::default)
            .seconds = 1_700_000_000 + taken;
        snapshots.push(snapshot.clone());
        Ok(Response::new(snapshot))
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        let mut snapshots = self.snapshots.lock().unwrap();
        let before = snapshots.len();
        snapshots.retain(|s| s.id != request.id);
        if snapshots.len() == before && !request.allow_missing {
            return Err(Status::not_found(format!(
                "snapshot {:?} does not exist",
                request.id
            )));
        }
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        self.saw(&request);
        let filter = request.into_inner();
        let matches = |want: &str, have: &str| want.is_empty() || want == have;
        let snapshots = self
            .snapshots
            .lock()
            .unwrap()
            .iter()
            .filter(|s| matches(&filter.id, &s.id))
            .filter(|s| matches(&filter.source_volume_id, &s.source_volume_id))
            .cloned()
            .collect();
        Ok(Response::new(ListSnapshotsResponse { snapshots }))
    }
}

#[tonic::async_trait]
impl NodeService for Fake {
    async fn get_node_info(
        &self,
        request: Request<GetNodeInfoRequest>,
    ) -> Result<Response<NodeInfo>, Status> {
        self.saw(&request);
        Ok(Response::new(NodeInfo {
            version: "0.1.0".into(),
            worker_cpus: vec![0, 1],
            volumes: u32::from(self.volume.lock().unwrap().is_some()),
            orphans: self.orphans.lock().unwrap().clone(),
            dataplane_error: self.dataplane_error.lock().unwrap().clone(),
            ..NodeInfo::default()
        }))
    }

    /// Like the real daemon: a backend is required, and what the spec leaves out (size 0,
    /// queues, depth) is the device's; unlike it, only the queues are checked against the device.
    async fn adopt_device(
        &self,
        request: Request<AdoptDeviceRequest>,
    ) -> Result<Response<Volume>, Status> {
        self.saw(&request);
        let request = request.into_inner();
        *self.adopted.lock().unwrap() = Some(request.clone());
        let mut orphans = self.orphans.lock().unwrap();
        let at = orphans
            .iter()
            .position(|o| o.dev_id == request.dev_id)
            .ok_or_else(|| {
                Status::not_found(format!("no orphan ublk device {}", request.dev_id))
            })?;
        let orphan = &orphans[at];
        let mut spec = request
            .spec
            .filter(|s| s.backend.is_some())
            .ok_or_else(|| Status::invalid_argument("a backend is required"))?;
        if spec.queues.is_some_and(|q| q != orphan.queues) {
            return Err(Status::invalid_argument(format!(
                "ublk device {} has {} queues",
                orphan.dev_id, orphan.queues
            )));
        }
        if spec.size_bytes == 0 {
            spec.size_bytes = orphan.size_bytes;
        }
        spec.queues = spec.queues.or(Some(orphan.queues));
        spec.queue_depth = spec.queue_depth.or(Some(orphan.queue_depth));
        let volume = Volume {
            id: request.id,
            spec: Some(spec),
            state: VolumeState::Ready.into(),
            device_path: format!("/dev/ublkb{}", orphan.dev_id),
            dev_id: orphan.dev_id,
            io_path_in_use: IoPath::PerIo.into(),
            ..Volume::default()
        };
        orphans.remove(at);
        *self.volume.lock().unwrap() = Some(volume.clone());
        Ok(Response::new(volume))
    }

    /// NVMe: a 1 GiB namespace with one 256 MiB window at 256 MiB; other backends: 5 GiB free.
    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<Capacity>, Status> {
        self.saw(&request);
        let mib = 1 << 20;
        let reply = match request.into_inner().backend {
            None => return Err(Status::invalid_argument("backend is required")),
            Some(get_capacity_request::Backend::Nvme(_)) => Capacity {
                available_bytes: 768 * mib,
                maximum_volume_bytes: 512 * mib,
                total_bytes: 1024 * mib,
                volumes_left: 9,
                free_extents: vec![
                    Extent {
                        offset_bytes: 0,
                        length_bytes: 256 * mib,
                    },
                    Extent {
                        offset_bytes: 512 * mib,
                        length_bytes: 512 * mib,
                    },
                ],
                reflink: false,
            },
            Some(_) => Capacity {
                available_bytes: 5 << 30,
                maximum_volume_bytes: 5 << 30,
                total_bytes: 8 << 30,
                volumes_left: 9,
                free_extents: Vec::new(),
                reflink: true,
            },
        };
        Ok(Response::new(reply))
    }

    async fn report_volumes_without_pv(
        &self,
        _request: Request<ublkd_proto::v1::ReportVolumesWithoutPvRequest>,
    ) -> Result<Response<ublkd_proto::v1::ReportVolumesWithoutPvResponse>, Status> {
        Err(Status::unimplemented("ublkctl never reports"))
    }

    async fn delete_orphan(
        &self,
        request: Request<DeleteOrphanRequest>,
    ) -> Result<Response<DeleteOrphanResponse>, Status> {
        self.saw(&request);
        let dev_id = request.into_inner().dev_id;
        // A volume's device is no orphan, so this refuses it too.
        let mut orphans = self.orphans.lock().unwrap();
        let before = orphans.len();
        orphans.retain(|o| o.dev_id != dev_id);
        if orphans.len() == before {
            return Err(Status::not_found(format!(
                "no orphan ublk device {dev_id} (devices of registered volumes are deleted \
                 with DeleteVolume)"
            )));
        }
        Ok(Response::new(DeleteOrphanResponse {}))
    }
}

/// A fake daemon with these orphan devices, serving on a fresh socket until the test's runtime
/// ends.
fn serve(orphans: Vec<OrphanDevice>) -> (Arc<Fake>, PathBuf) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "ublkctl-test-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let fake = Arc::new(Fake {
        orphans: Mutex::new(orphans),
        ..Fake::default()
    });
    let server = tonic::transport::Server::builder()
        .add_service(VolumeServiceServer::from_arc(fake.clone()))
        .add_service(NodeServiceServer::from_arc(fake.clone()))
        .serve_with_incoming(UnixListenerStream::new(listener));
    tokio::spawn(server);
    (fake, path)
}

async fn run(socket: &std::path::Path, args: &[&str]) -> Result<String, crate::error::Error> {
    let endpoint = format!("unix://{}", socket.display());
    let cli = Cli::try_parse_from(
        ["ublkctl", "--endpoint", &endpoint, "--timeout", "7"]
            .into_iter()
            .chain(args.iter().copied()),
    )
    .unwrap();
    let Command::Call(call) = &cli.command else {
        panic!("{args:?} is no call")
    };
    execute(&cli, call).await
}

#[tokio::test]
async fn volume_lifecycle_against_a_fake_daemon() {
    let (fake, sock) = serve(Vec::new());

    let out = run(
        &sock,
        &[
            "create-volume",
            "vol-1",
            "--size",
            "1GiB",
            "--backend",
            "file+create:/srv/vol-1.img",
        ],
    )
    .await
    .unwrap();
    assert_eq!(out, "/dev/ublkb0");
    // --timeout 7 travels as the gRPC deadline (tonic writes it in microseconds).
    assert_eq!(
        fake.deadline_header.lock().unwrap().as_deref(),
        Some("7000000u")
    );

    let out = run(&sock, &["list-volumes"]).await.unwrap();
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .starts_with("vol-1  ready  1 GiB  file+create:/srv/vol-1.img"),
        "{out}"
    );

    let out = run(
        &sock,
        &["resize-volume", "vol-1", "--size", "2Gi", "-o", "json"],
    )
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["spec"]["size_bytes"], 2u64 << 30);

    let err = run(&sock, &["resize-volume", "vol-1", "--size", "1Gi"])
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "failed precondition: volumes only grow");

    let out = run(&sock, &["stats", "vol-1"]).await.unwrap();
    assert!(out.contains("mean latency: 2.0 ms"), "{out}");

    let out = run(&sock, &["node-info", "-o", "json"]).await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["volumes"], 1);

    let out = run(&sock, &["delete-volume", "vol-1"]).await.unwrap();
    assert_eq!(out, "deleted volume \"vol-1\"");

    let err = run(&sock, &["get-volume", "vol-1"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert_eq!(
        err.to_string(),
        "not found: volume \"vol-1\" does not exist"
    );

    run(&sock, &["delete-volume", "vol-1", "--allow-missing"])
        .await
        .unwrap();
    let _ = std::fs::remove_file(&sock);
}

fn orphan(dev_id: u32, state: &str, size_bytes: u64) -> OrphanDevice {
    OrphanDevice {
        dev_id,
        state: state.into(),
        server_pid: 4000 + i32::try_from(dev_id).unwrap(),
        size_bytes,
        queues: 2,
        queue_depth: 64,
    }
}

#[tokio::test]
async fn orphans_against_a_fake_daemon() {
    let (fake, sock) = serve(vec![
        orphan(3, "quiesced", 1 << 30),
        orphan(5, "dead", 2 << 30),
        orphan(7, "live", 512 << 20),
        orphan(9, "fail_io", 4096),
    ]);

    let out = run(&sock, &["orphans"]).await.unwrap();
    let expected = "\
DEV ID  STATE        SIZE  QUEUES  DEPTH  SERVER PID
     3  quiesced    1 GiB       2     64        4003
     5  dead        2 GiB       2     64        4005
     7  live      512 MiB       2     64        4007
     9  fail_io     4 KiB       2     64        4009";
    assert_eq!(out, expected);

    let out = run(&sock, &["node-info"]).await.unwrap();
    assert!(
        out.contains("\norphan 5:      dead, 2 GiB, 2 queues x 64, server pid 4005\n"),
        "{out}"
    );
    let out = run(&sock, &["node-info", "-o", "json"]).await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["orphans"].as_array().unwrap().len(), 4);
    assert_eq!(json["orphans"][2]["state"], "live");

    // Without --size the request says 0 and the daemon takes the device's.
    let out = run(&sock, &["adopt-device", "3", "vol-a", "--backend", "ram"])
        .await
        .unwrap();
    assert_eq!(out, "/dev/ublkb3");
    let sent = fake.adopted.lock().unwrap().clone().unwrap();
    assert_eq!((sent.dev_id, sent.id.as_str()), (3, "vol-a"));
    let spec = sent.spec.unwrap();
    assert_eq!(spec.size_bytes, 0);
    assert_eq!(spec.backend, Some(Backend::Ram(RamBackend {})));
    assert_eq!(
        fake.deadline_header.lock().unwrap().as_deref(),
        Some("7000000u")
    );

    let err = run(&sock, &["adopt-device", "3", "vol-a", "--backend", "ram"])
        .await
        .unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert_eq!(err.to_string(), "not found: no orphan ublk device 3");

    let err = run(
        &sock,
        &[
            "adopt-device",
            "5",
            "vol-b",
            "--backend",
            "ram",
            "--queues",
            "4",
        ],
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument: ublk device 5 has 2 queues"
    );

    let out = run(
        &sock,
        &[
            "adopt-device",
            "5",
            "vol-b",
            "--backend",
            "file:/srv/vol-b.img",
            "--size",
            "2GiB",
            "--queues",
            "2",
            "-o",
            "json",
        ],
    )
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["id"], "vol-b");
    assert_eq!(json["dev_id"], 5);
    assert_eq!(json["device_path"], "/dev/ublkb5");
    assert_eq!(json["spec"]["size_bytes"], 2u64 << 30);
    assert_eq!(json["spec"]["queue_depth"], 64, "the device's");
    assert_eq!(json["spec"]["file"]["path"], "/srv/vol-b.img");

    let err = run(&sock, &["delete-orphan", "5"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    assert!(
        err.to_string()
            .starts_with("not found: no orphan ublk device 5 (devices of registered volumes"),
        "{err}"
    );

    let out = run(&sock, &["delete-orphan", "7"]).await.unwrap();
    assert_eq!(out, "deleted orphan ublk device 7");
    let err = run(&sock, &["delete-orphan", "7"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 1);
    let out = run(&sock, &["delete-orphan", "9", "-o", "json"])
        .await
        .unwrap();
    assert_eq!(out, "{}");

    let out = run(&sock, &["orphans"]).await.unwrap();
    assert_eq!(out, "no orphan ublk devices");
    let out = run(&sock, &["orphans", "-o", "json"]).await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        json,
        serde_json::json!({ "orphans": [], "volumes_without_pv": [] })
    );
    let out = run(&sock, &["node-info"]).await.unwrap();
    assert!(
        out.ends_with("\nvolumes:       1\norphans:       none"),
        "{out}"
    );
    let _ = std::fs::remove_file(&sock);
}

#[tokio::test]
async fn capacity_against_a_fake_daemon() {
    let (_fake, sock) = serve(Vec::new());
    let text = run(&sock, &["capacity", "nvme:/dev/ng0n1"]).await.unwrap();
    assert!(text.contains("available:      768 MiB"), "{text}");
    assert!(text.contains("largest volume: 512 MiB"), "{text}");
    assert!(
        text.contains("free extents:   0B+256MiB 512MiB+512MiB"),
        "{text}"
    );
    let json = run(&sock, &["-o", "json", "capacity", "file:/srv/ublkd"])
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["available_bytes"], 5u64 << 30);
    assert_eq!(v["volumes_left"], 9);
    assert!(Cli::try_parse_from(["ublkctl", "capacity", "disk:/x"]).is_err());
    let _ = std::fs::remove_file(&sock);
}

#[tokio::test]
async fn node_info_ready_fails_with_exit_4_while_ublkd_has_no_dataplane() {
    let (fake, sock) = serve(Vec::new());
    let text = run(&sock, &["node-info", "--ready"]).await.unwrap();
    assert!(text.contains("version:"), "{text}");
    assert!(!text.contains("dataplane"), "{text}");
    let why = "ublk control command failed: cannot open /dev/ublk-control";
    *fake.dataplane_error.lock().unwrap() = why.into();
    let err = run(&sock, &["node-info", "--ready"]).await.unwrap_err();
    assert_eq!(err.exit_code(), 4);
    assert_eq!(
        err.to_string(),
        format!("not ready: ublkd serves no volume: {why}")
    );
    // Without --ready it is a report, not a failure.
    let text = run(&sock, &["node-info"]).await.unwrap();
    assert!(
        text.contains(&format!("dataplane:     none: {why}")),
        "{text}"
    );
    let json = run(&sock, &["-o", "json", "node-info"]).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["dataplane_error"], why);
    let _ = std::fs::remove_file(&sock);
}
