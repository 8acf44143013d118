//! The Controller service over a real unix socket, in front of a fake ublkd that keeps volumes
//! and snapshots in memory: what the driver asks ublkd for (limits, sources, snapshot ids) and
//! what it answers the sidecars, without a kernel. The real ublkd is exercised in the VM tests
//! (tests/tests/csi.rs).

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Code, Request, Response, Status};
use ublkd_client::v1::{self, volume_spec::Backend, volume_spec::Source};
use ublkd_csi::controller::ControllerService;
use ublkd_csi::modify::Route;
use ublkd_csi::spec::controller_client::ControllerClient;
use ublkd_csi::spec::controller_server::ControllerServer;
use ublkd_csi::spec::volume_capability::{access_mode::Mode, AccessMode, AccessType};
use ublkd_csi::spec::{self, volume_content_source as vcs, VolumeCapability};
use ublkd_csi::ublkd::Ublkd;
use ublkd_csi::Node;

/// Backing files under this directory are on a file system that "cannot reflink".
const NO_REFLINK: &str = "/ext4/";

#[derive(Debug, Default)]
struct State {
    volumes: BTreeMap<String, v1::Volume>,
    snapshots: BTreeMap<String, v1::Snapshot>,
    /// ublkd runs without a dataplane: GetCapacity answers all zero, as ublkd does then.
    no_dataplane: bool,
}

/// ublkd as the driver sees it: ids, specs, sources and limits; no devices.
#[derive(Debug, Clone, Default)]
struct FakeUblkd(Arc<Mutex<State>>);

fn file_of(v: &v1::Volume) -> Option<&str> {
    match v.spec.as_ref()?.backend.as_ref()? {
        Backend::File(f) => Some(&f.path),
        _ => None,
    }
}

/// What ublkd says of a source it cannot copy.
fn check_copyable(v: &v1::Volume) -> Result<(), Status> {
    match file_of(v) {
        None => Err(Status::failed_precondition("not a file volume")),
        Some(p) if p.starts_with(NO_REFLINK) => Err(Status::failed_precondition(format!(
            "{p} is on ext4, which cannot reflink"
        ))),
        Some(_) => Ok(()),
    }
}

#[tonic::async_trait]
impl v1::volume_service_server::VolumeService for FakeUblkd {
    async fn create_volume(
        &self,
        req: Request<v1::CreateVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        let req = req.into_inner();
        let mut st = self.0.lock().unwrap();
        if let Some(v) = st.volumes.get(&req.id) {
            return Ok(Response::new(v.clone()));
        }
        let spec = req.spec.unwrap_or_default();
        match &spec.source {
            Some(Source::FromSnapshot(id)) => {
                let s = st
                    .snapshots
                    .get(id)
                    .ok_or_else(|| Status::not_found("no such snapshot"))?;
                if spec.size_bytes < s.size_bytes {
                    return Err(Status::invalid_argument("smaller than the snapshot"));
                }
            }
            Some(Source::FromVolume(id)) => {
                let v = st
                    .volumes
                    .get(id)
                    .ok_or_else(|| Status::not_found("no such volume"))?;
                check_copyable(v)?;
            }
            None => {}
        }
        let n = st.volumes.len();
        let v = v1::Volume {
            id: req.id.clone(),
            spec: Some(spec),
            state: v1::VolumeState::Ready as i32,
            device_path: format!("/dev/ublkb{n}"),
            ..Default::default()
        };
        if let Some(p) = file_of(&v).filter(|p| p.starts_with(NO_REFLINK)) {
            if v.spec.as_ref().unwrap().source.is_some() {
                return Err(Status::failed_precondition(format!(
                    "{p} is on ext4, which cannot reflink"
                )));
            }
        }
        st.volumes.insert(req.id, v.clone());
        Ok(Response::new(v))
    }

    async fn delete_volume(
        &self,
        req: Request<v1::DeleteVolumeRequest>,
    ) -> Result<Response<v1::DeleteVolumeResponse>, Status> {
        self.0.lock().unwrap().volumes.remove(&req.into_inner().id);
        Ok(Response::new(v1::DeleteVolumeResponse {}))
    }

    async fn get_volume(
        &self,
        req: Request<v1::GetVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        let st = self.0.lock().unwrap();
        st.volumes
            .get(&req.into_inner().id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found("no such volume"))
    }

    async fn list_volumes(
        &self,
        _req: Request<v1::ListVolumesRequest>,
    ) -> Result<Response<v1::ListVolumesResponse>, Status> {
        let st = self.0.lock().unwrap();
        Ok(Response::new(v1::ListVolumesResponse {
            volumes: st.volumes.values().cloned().collect(),
        }))
    }

    async fn resize_volume(
        &self,
        _req: Request<v1::ResizeVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_volume_stats(
        &self,
        _req: Request<v1::GetVolumeStatsRequest>,
    ) -> Result<Response<v1::VolumeStats>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn set_volume_qos(
        &self,
        req: Request<v1::SetVolumeQosRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        let req = req.into_inner();
        let mut st = self.0.lock().unwrap();
        let v = st
            .volumes
            .get_mut(&req.id)
            .ok_or_else(|| Status::not_found("no such volume"))?;
        let spec = v.spec.get_or_insert_with(Default::default);
        spec.qos = req.qos.filter(|q| *q != v1::QosLimits::default());
        Ok(Response::new(v.clone()))
    }

    async fn create_snapshot(
        &self,
        req: Request<v1::CreateSnapshotRequest>,
    ) -> Result<Response<v1::Snapshot>, Status> {
        let req = req.into_inner();
        let mut st = self.0.lock().unwrap();
        if let Some(s) = st.snapshots.get(&req.id) {
            if s.source_volume_id != req.source_volume_id {
                return Err(Status::already_exists("of another volume"));
            }
            return Ok(Response::new(s.clone()));
        }
        let v = st
            .volumes
            .get(&req.source_volume_id)
            .ok_or_else(|| Status::not_found("no such volume"))?;
        check_copyable(v)?;
        let s = v1::Snapshot {
            id: req.id.clone(),
            source_volume_id: req.source_volume_id,
            size_bytes: v.spec.as_ref().unwrap().size_bytes,
            created: Some(prost_types::Timestamp {
                seconds: 1_800_000_000,
                nanos: 0,
            }),
            path: format!("/srv/.ublkd-snapshots/{}.img", req.id),
            ready: true,
        };
        st.snapshots.insert(req.id, s.clone());
        Ok(Response::new(s))
    }

    async fn delete_snapshot(
        &self,
        req: Request<v1::DeleteSnapshotRequest>,
    ) -> Result<Response<v1::DeleteSnapshotResponse>, Status> {
        self.0
            .lock()
            .unwrap()
            .snapshots
            .remove(&req.into_inner().id);
        Ok(Response::new(v1::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<v1::ListSnapshotsRequest>,
    ) -> Result<Response<v1::ListSnapshotsResponse>, Status> {
        let req = req.into_inner();
        let st = self.0.lock().unwrap();
        let snapshots = st
            .snapshots
            .values()
            .filter(|s| req.id.is_empty() || s.id == req.id)
            .filter(|s| {
                req.source_volume_id.is_empty() || s.source_volume_id == req.source_volume_id
            })
            .cloned()
            .collect();
        Ok(Response::new(v1::ListSnapshotsResponse { snapshots }))
    }
}

#[tonic::async_trait]
impl v1::node_service_server::NodeService for FakeUblkd {
    async fn get_node_info(
        &self,
        _req: Request<v1::GetNodeInfoRequest>,
    ) -> Result<Response<v1::NodeInfo>, Status> {
        Ok(Response::new(v1::NodeInfo::default()))
    }

    async fn adopt_device(
        &self,
        _req: Request<v1::AdoptDeviceRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn report_volumes_without_pv(
        &self,
        _req: Request<v1::ReportVolumesWithoutPvRequest>,
    ) -> Result<Response<v1::ReportVolumesWithoutPvResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn delete_orphan(
        &self,
        _req: Request<v1::DeleteOrphanRequest>,
    ) -> Result<Response<v1::DeleteOrphanResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_capacity(
        &self,
        _req: Request<v1::GetCapacityRequest>,
    ) -> Result<Response<v1::Capacity>, Status> {
        if self.0.lock().unwrap().no_dataplane {
            return Ok(Response::new(v1::Capacity::default()));
        }
        Ok(Response::new(v1::Capacity {
            available_bytes: 1 << 40,
            maximum_volume_bytes: 1 << 40,
            total_bytes: 1 << 40,
            volumes_left: 100,
            free_extents: Vec::new(),
            reflink: false,
        }))
    }
}

fn unix(path: &Path) -> ublkd_client::Target {
    ublkd_client::Target::Unix(path.to_owned())
}

impl FakeUblkd {
    fn router(&self) -> tonic::transport::server::Router {
        tonic::transport::Server::builder()
            .add_service(v1::volume_service_server::VolumeServiceServer::new(
                self.clone(),
            ))
            .add_service(v1::node_service_server::NodeServiceServer::new(
                self.clone(),
            ))
    }
}

/// A driver in front of `ublkd`, on its own socket in `dir`; its client.
async fn driver(
    dir: &Path,
    ublkd: Ublkd,
    route: Route,
) -> ControllerClient<tonic::transport::Channel> {
    let csi_sock = dir.join("csi.sock");
    let listener = tokio::net::UnixListener::bind(&csi_sock).unwrap();
    let service = ControllerService {
        ublkd,
        node: Node("node-a".into()),
        route,
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ControllerServer::new(service))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let channel = ublkd_client::connect(&ublkd_client::Connection {
        target: unix(&csi_sock),
        tls: Default::default(),
        timeout: Duration::from_secs(5),
    })
    .await
    .unwrap();
    ControllerClient::new(channel)
}

/// A fake ublkd on a unix socket and a driver in front of it; the driver's client.
async fn start(
    dir: &Path,
    route: Route,
) -> (FakeUblkd, ControllerClient<tonic::transport::Channel>) {
    let fake = FakeUblkd::default();
    let ublkd_sock = dir.join("ublkd.sock");
    let listener = tokio::net::UnixListener::bind(&ublkd_sock).unwrap();
    tokio::spawn(
        fake.router()
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let ublkd = Ublkd::new(unix(&ublkd_sock), Duration::from_secs(5));
    (fake, driver(dir, ublkd, route).await)
}

fn kv(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn create(name: &str, size: i64, params: &[(&str, &str)]) -> spec::CreateVolumeRequest {
    spec::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(spec::CapacityRange {
            required_bytes: size,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Block(Default::default())),
        }],
        parameters: kv(params),
        ..Default::default()
    }
}

fn modify(id: &str, params: &[(&str, &str)]) -> spec::ControllerModifyVolumeRequest {
    spec::ControllerModifyVolumeRequest {
        volume_id: id.into(),
        mutable_parameters: kv(params),
        secrets: HashMap::new(),
    }
}

const FILE: &[(&str, &str)] = &[("backend", "file"), ("root", "/srv/ublkd")];

impl FakeUblkd {
    fn volume(&self, id: &str) -> v1::Volume {
        self.0.lock().unwrap().volumes[id].clone()
    }

    fn qos(&self, id: &str) -> v1::QosLimits {
        self.volume(id).spec.and_then(|s| s.qos).unwrap_or_default()
    }
}

#[tokio::test]
async fn limits_come_from_both_classes_and_modify_merges_over_them() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut c) = start(dir.path(), Route::Local).await;
    let mut req = create(
        "pvc-qos",
        1 << 20,
        &[
            ("backend", "ram"),
            ("readIops", "1000"),
            ("writeIops", "50"),
        ],
    );
    // A VolumeAttributesClass at creation wins over the StorageClass.
    req.mutable_parameters = kv(&[("writeIops", "500"), ("writeBandwidth", "100Mi")]);
    c.create_volume(req).await.unwrap();
    assert_eq!(
        fake.qos("pvc-qos"),
        v1::QosLimits {
            read_iops: 1000,
            write_iops: 500,
            write_bytes_per_second: 100 << 20,
            ..Default::default()
        }
    );

    c.controller_modify_volume(modify(
        "pvc-qos",
        &[("writeBandwidth", "unlimited"), ("qosBurst", "2s")],
    ))
    .await
    .unwrap();
    let merged = v1::QosLimits {
        read_iops: 1000,
        write_iops: 500,
        write_bytes_per_second: 0,
        read_bytes_per_second: 0,
        burst_ms: 2000,
    };
    assert_eq!(fake.qos("pvc-qos"), merged, "only the keys named changed");

    // Refused calls change nothing.
    let e = c
        .controller_modify_volume(modify(
            "pvc-qos",
            &[("readIops", "1"), ("XXX_FakeKey", "XXX_FakeValue")],
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c
        .controller_modify_volume(modify("pvc-qos", &[("readBandwidth", "fast")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(fake.qos("pvc-qos"), merged);

    c.controller_modify_volume(modify("pvc-qos", &[]))
        .await
        .unwrap();
    assert_eq!(fake.qos("pvc-qos"), merged, "no key, no change");
    let e = c
        .controller_modify_volume(modify("non-existing-volume-id", &[("readIops", "1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = c
        .controller_modify_volume(modify("", &[("readIops", "1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    let mut bad = create("pvc-bad", 1 << 20, &[("backend", "ram")]);
    bad.mutable_parameters = kv(&[("XXX_FakeKey", "XXX_FakeValue")]);
    let e = c.create_volume(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(!fake.0.lock().unwrap().volumes.contains_key("pvc-bad"));
}

#[tokio::test]
async fn snapshots_are_taken_listed_in_pages_and_restored_on_this_node() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut c) = start(dir.path(), Route::Local).await;
    let src = c
        .create_volume(create("pvc-src", 8 << 20, FILE))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(src.content_source, None);

    let snap = |name: &str, source: &str| spec::CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        ..Default::default()
    };
    let s1 = c
        .create_snapshot(snap("Snapshot One", "pvc-src"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(s1.snapshot_id.starts_with("snap-"), "{s1:?}");
    assert!(s1.ready_to_use && s1.size_bytes == 8 << 20, "{s1:?}");
    assert_eq!(s1.source_volume_id, "pvc-src");
    let again = c
        .create_snapshot(snap("Snapshot One", "pvc-src"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(again.snapshot_id, s1.snapshot_id, "idempotent by name");
    c.create_volume(create("pvc-other", 8 << 20, FILE))
        .await
        .unwrap();
    let e = c
        .create_snapshot(snap("Snapshot One", "pvc-other"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    for name in ["snapshot-b", "snapshot-c"] {
        c.create_snapshot(snap(name, "pvc-other")).await.unwrap();
    }

    // Pages of two, by token; filters by id and by source.
    let list = |max: i32, token: &str, id: &str, source: &str| spec::ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.into(),
        source_volume_id: source.into(),
        snapshot_id: id.into(),
        secrets: HashMap::new(),
    };
    let p1 = c
        .list_snapshots(list(2, "", "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p1.entries.len(), 2);
    assert!(!p1.next_token.is_empty());
    let p2 = c
        .list_snapshots(list(0, &p1.next_token, "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((p2.entries.len(), p2.next_token.as_str()), (1, ""));
    let mut ids: Vec<String> = p1
        .entries
        .iter()
        .chain(&p2.entries)
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{ids:?}");
    let by_source = c
        .list_snapshots(list(0, "", "", "pvc-src"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 1);
    let by_id = c
        .list_snapshots(list(0, "", "snapshot-c", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        by_id.entries[0].snapshot.as_ref().unwrap().source_volume_id,
        "pvc-other"
    );
    for (id, source) in [("none-exist-id", ""), ("", "No Such Volume")] {
        let none = c
            .list_snapshots(list(0, "", id, source))
            .await
            .unwrap()
            .into_inner();
        assert!(none.entries.is_empty());
    }
    let e = c
        .list_snapshots(list(0, "garbage", "", ""))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Aborted);

    // A restore: at least the snapshot's size, its source echoed and recorded.
    let from = |kind: vcs::Type| spec::VolumeContentSource { r#type: Some(kind) };
    let of_snapshot = from(vcs::Type::Snapshot(vcs::SnapshotSource {
        snapshot_id: s1.snapshot_id.clone(),
    }));
    let mut r = create("pvc-restored", 4096, FILE);
    r.volume_content_source = Some(of_snapshot.clone());
    let restored = c
        .create_volume(r.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(restored.content_source.as_ref(), Some(&of_snapshot));
    assert_eq!(
        restored.capacity_bytes,
        8 << 20,
        "grown to the source's size"
    );
    assert_eq!(
        fake.volume("pvc-restored").spec.unwrap().source,
        Some(Source::FromSnapshot(s1.snapshot_id.clone()))
    );
    let retried = c
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(retried.content_source, Some(of_snapshot));
    let mut other_source = create("pvc-restored", 8 << 20, FILE);
    other_source.volume_content_source = Some(from(vcs::Type::Volume(vcs::VolumeSource {
        volume_id: "pvc-src".into(),
    })));
    let e = c.create_volume(other_source).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");

    // A clone.
    let of_volume = from(vcs::Type::Volume(vcs::VolumeSource {
        volume_id: "pvc-src".into(),
    }));
    let mut r = create("pvc-clone", 8 << 20, FILE);
    r.volume_content_source = Some(of_volume.clone());
    let clone = c
        .create_volume(r)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(clone.content_source, Some(of_volume.clone()));
    let listed = c
        .list_volumes(spec::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let entry = listed
        .entries
        .iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == "pvc-clone")
        .unwrap();
    assert_eq!(
        entry.volume.as_ref().unwrap().content_source,
        Some(of_volume)
    );

    // Sources that are not there, or cannot be copied.
    let cases = [
        (
            "missing snapshot",
            FILE,
            from(vcs::Type::Snapshot(vcs::SnapshotSource {
                snapshot_id: "non-existing-snapshot-id".into(),
            })),
            Code::NotFound,
        ),
        (
            "missing volume",
            FILE,
            from(vcs::Type::Volume(vcs::VolumeSource {
                volume_id: "Not A Volume Id".into(),
            })),
            Code::NotFound,
        ),
        (
            "into a ram volume",
            &[("backend", "ram")][..],
            from(vcs::Type::Snapshot(vcs::SnapshotSource {
                snapshot_id: s1.snapshot_id.clone(),
            })),
            Code::InvalidArgument,
        ),
        (
            "onto a file system that cannot reflink",
            &[("backend", "file"), ("root", "/ext4/volumes")][..],
            from(vcs::Type::Snapshot(vcs::SnapshotSource {
                snapshot_id: s1.snapshot_id.clone(),
            })),
            Code::InvalidArgument,
        ),
        (
            "without a type",
            FILE,
            spec::VolumeContentSource { r#type: None },
            Code::InvalidArgument,
        ),
    ];
    for (what, params, source, code) in cases {
        let mut r = create("pvc-refused", 8 << 20, params);
        r.volume_content_source = Some(source);
        let e = c.create_volume(r).await.unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e:?}");
    }
    assert!(!fake.0.lock().unwrap().volumes.contains_key("pvc-refused"));

    // Volumes that cannot be snapshotted.
    c.create_volume(create("pvc-ram", 1 << 20, &[("backend", "ram")]))
        .await
        .unwrap();
    c.create_volume(create(
        "pvc-ext4",
        1 << 20,
        &[("backend", "file"), ("root", "/ext4/volumes")],
    ))
    .await
    .unwrap();
    for (source, code) in [
        ("pvc-ram", Code::InvalidArgument),
        ("pvc-ext4", Code::InvalidArgument),
        ("pvc-gone", Code::NotFound),
    ] {
        let e = c
            .create_snapshot(snap("s-refused", source))
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{source}: {e:?}");
    }
    for (name, source) in [("", "pvc-src"), ("s", "")] {
        let e = c.create_snapshot(snap(name, source)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    }

    let del = |id: &str| spec::DeleteSnapshotRequest {
        snapshot_id: id.into(),
        secrets: HashMap::new(),
    };
    c.delete_snapshot(del(&s1.snapshot_id)).await.unwrap();
    c.delete_snapshot(del(&s1.snapshot_id)).await.unwrap();
    c.delete_snapshot(del("reallyfakesnapshotid"))
        .await
        .unwrap();
    c.delete_snapshot(del("Not A Snapshot")).await.unwrap();
    let e = c.delete_snapshot(del("")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(!fake
        .0
        .lock()
        .unwrap()
        .snapshots
        .contains_key(&s1.snapshot_id));
}

#[tokio::test]
async fn a_node_without_a_dataplane_offers_zero_capacity_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut c) = start(dir.path(), Route::Local).await;
    let ask = || spec::GetCapacityRequest {
        parameters: kv(FILE),
        ..Default::default()
    };
    let before = c.get_capacity(ask()).await.unwrap().into_inner();
    assert_eq!(before.available_capacity, 1 << 40);
    fake.0.lock().unwrap().no_dataplane = true;
    // An answer, not an error: the provisioner replaces the node's CSIStorageCapacity with it
    // (on an error it would keep the last one).
    let now = c.get_capacity(ask()).await.unwrap().into_inner();
    assert_eq!(now.available_capacity, 0);
    assert_eq!(now.maximum_volume_size, Some(0));
}

#[tokio::test]
async fn modify_is_offered_and_a_bad_key_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, mut c) = start(dir.path(), Route::Local).await;
    use spec::controller_service_capability::{rpc::Type, Type as Cap};
    let caps: Vec<i32> = c
        .controller_get_capabilities(spec::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(Cap::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect();
    for t in [
        Type::ModifyVolume,
        Type::CreateDeleteSnapshot,
        Type::ListSnapshots,
        Type::CloneVolume,
    ] {
        assert!(caps.contains(&(t as i32)), "{t:?} in {caps:?}");
    }
    c.create_volume(create("pvc-1", 1 << 20, &[("backend", "ram")]))
        .await
        .unwrap();
    let e = c
        .controller_modify_volume(modify(
            "pvc-1",
            &[("readIops", "100"), ("XXX_FakeKey", "x")],
        ))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::InvalidArgument,
        "parameters are checked first"
    );
    assert_eq!(
        fake.qos("pvc-1"),
        v1::QosLimits::default(),
        "nothing changed"
    );
}

/// A CA, a server certificate for 127.0.0.1 (what each node's ublkd presents) and a client
/// certificate (the resizer's driver's), made by openssl as client/tests/tls.rs makes them.
const PKI: &str = r#"
set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=ca 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
for n in server client; do
    openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr -subj /CN=$n 2>/dev/null
    openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem -days 1 -extfile $n.ext 2>/dev/null
done
"#;

#[tokio::test]
async fn the_central_driver_changes_limits_on_the_node_that_holds_the_volume() {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let dir = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("sh")
        .arg("-c")
        .arg(PKI)
        .current_dir(dir.path())
        .status()
        .expect("sh runs")
        .success();
    assert!(ok, "openssl made the certificates");
    let read = |f: &str| std::fs::read(dir.path().join(f)).unwrap();

    // A node's ublkd: gRPC with mutual TLS, as remote access serves it.
    let fake = FakeUblkd::default();
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(read("server.pem"), read("server.key")))
        .client_ca_root(Certificate::from_pem(read("ca.pem")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let router = tonic::transport::Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(v1::volume_service_server::VolumeServiceServer::new(
            fake.clone(),
        ));
    tokio::spawn(
        router.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    fake.0.lock().unwrap().volumes.insert(
        "pvc-1".into(),
        v1::Volume {
            id: "pvc-1".into(),
            spec: Some(v1::VolumeSpec {
                qos: Some(v1::QosLimits {
                    read_iops: 100,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            state: v1::VolumeState::Ready as i32,
            ..Default::default()
        },
    );

    let files = ublkd_client::TlsFiles {
        ca: Some(dir.path().join("ca.pem")),
        cert: Some(dir.path().join("client.pem")),
        key: Some(dir.path().join("client.key")),
        domain: None,
    };
    let t = Duration::from_secs(5);
    let remote =
        ublkd_csi::modify::Remote::new(&format!("https://127.0.0.1:{port}"), files.clone(), t)
            .unwrap();
    // The driver's own ublkd is not there: the central one has none.
    let nowhere = Ublkd::new(unix(&dir.path().join("none.sock")), t);
    let mut c = driver(dir.path(), nowhere, Route::Remote(remote)).await;
    c.controller_modify_volume(modify("pvc-1", &[("writeBandwidth", "50Mi")]))
        .await
        .unwrap();
    assert_eq!(
        fake.qos("pvc-1"),
        v1::QosLimits {
            read_iops: 100,
            write_bytes_per_second: 50 << 20,
            ..Default::default()
        },
        "set on the node, over what it had"
    );
    let e = c
        .controller_modify_volume(modify("pvc-2", &[("readIops", "1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "every node answered: {e:?}");

    // A node that does not answer: never NOT_FOUND, never done.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().port();
    drop(closed);
    let remote =
        ublkd_csi::modify::Remote::new(&format!("https://127.0.0.1:{dead}"), files, t).unwrap();
    let other = tempfile::tempdir().unwrap();
    let nowhere = Ublkd::new(unix(&other.path().join("none.sock")), t);
    let mut c = driver(other.path(), nowhere, Route::Remote(remote)).await;
    let e = c
        .controller_modify_volume(modify("pvc-1", &[("readIops", "1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        e.message().contains(&format!("127.0.0.1:{dead}")),
        "{}",
        e.message()
    );
}
