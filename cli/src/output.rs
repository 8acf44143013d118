//! Rendering replies: aligned text for people, JSON for programs.
//!
//! Text shows sizes with `format_size` and enums in lower case (`ready`, `per-io`). JSON follows
//! the proto3 JSON mapping with the proto's own (snake_case) field names and enum value names
//! (`VOLUME_STATE_READY`), unset optional fields left out, except that 64-bit integers are
//! numbers, not strings, so `jq` can do arithmetic on them. Every function returns the text
//! without a final newline.

use crate::qos::{limits_cell, limits_text};
use crate::snapshot::source_text;
use crate::writer::{fields, or_dash, pretty, table, Align};
use serde_json::{json, Value};
use ublkd_proto::notation::{backend_text, io_path_text};
use ublkd_proto::units::{compact_size, format_size};
use ublkd_proto::v1::{
    volume_spec::Backend, Capacity, IoPath, NodeInfo, OrphanDevice, PlacementReason, PollReason,
    QueuePlacement, Toggle, Volume, VolumeState, VolumeStats,
};

/// `VOLUME_STATE_READY` -> `ready`; unknown values as their number.
fn state_word(state: i32) -> String {
    VolumeState::try_from(state).map_or_else(
        |_| state.to_string(),
        |s| {
            s.as_str_name()
                .trim_start_matches("VOLUME_STATE_")
                .to_ascii_lowercase()
        },
    )
}

/// An I/O path as `--io-path` spells it (its number when this client does not know it).
fn io_path_word(path: i32) -> String {
    IoPath::try_from(path).map_or_else(|_| path.to_string(), |p| io_path_text(p).to_owned())
}

fn or_default(n: Option<u32>) -> String {
    n.map_or_else(|| "server default".into(), |n| n.to_string())
}

/// The `list-volumes` table.
pub fn volumes_table(volumes: &[Volume], with_header: bool) -> String {
    use Align::Left;
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            let spec = v.spec.as_ref();
            vec![
                v.id.clone(),
                state_word(v.state),
                spec.map_or_else(|| "-".into(), |s| format_size(s.size_bytes)),
                backend_text(spec.and_then(|s| s.backend.as_ref())),
                or_dash(&v.device_path),
                io_path_word(v.io_path_in_use),
                limits_cell(spec.and_then(|s| s.qos.as_ref())),
            ]
        })
        .collect();
    table(
        &[
            ("ID", Left),
            ("STATE", Left),
            ("SIZE", Left),
            ("BACKEND", Left),
            ("DEVICE", Left),
            ("IO PATH", Left),
            ("QOS", Left),
        ],
        &rows,
        with_header,
    )
}

/// One volume, field by field (`get-volume`, `resize-volume`).
pub fn volume_text(v: &Volume) -> String {
    let spec = v.spec.clone().unwrap_or_default();
    let mut pairs = vec![
        ("id", v.id.clone()),
        ("state", state_word(v.state)),
        (
            "size",
            format!(
                "{} ({} bytes)",
                format_size(spec.size_bytes),
                spec.size_bytes
            ),
        ),
        ("backend", backend_text(spec.backend.as_ref())),
    ];
    // An NVMe window's namespace by identity: the name that holds across boots.
    if let Some(Backend::Nvme(n)) = &spec.backend {
        if !n.identity.is_empty() {
            pairs.push(("namespace", n.identity.clone()));
        }
    }
    pairs.extend([
        ("block size", or_default(spec.block_size)),
        ("queues", or_default(spec.queues)),
        ("queue depth", or_default(spec.queue_depth)),
        (
            "io path",
            format!(
                "{} (in use: {})",
                io_path_word(spec.io_path),
                io_path_word(v.io_path_in_use)
            ),
        ),
        (
            "zero copy",
            format!(
                "{} (in use: {})",
                toggle_word(spec.zero_copy),
                in_use(v, v.zero_copy_in_use)
            ),
        ),
        (
            "poll",
            match poll_reason_words(v.poll_reason) {
                Some(why) if !v.device_path.is_empty() => format!(
                    "{} (in use: {}: {why})",
                    toggle_word(spec.poll),
                    in_use(v, v.polled)
                ),
                _ => format!(
                    "{} (in use: {})",
                    toggle_word(spec.poll),
                    in_use(v, v.polled)
                ),
            },
        ),
        ("placement", placement_text(v)),
        ("qos", limits_text(spec.qos.as_ref())),
        (
            "device",
            if v.device_path.is_empty() {
                "-".into()
            } else {
                format!("{} (ublk id {})", v.device_path, v.dev_id)
            },
        ),
        (
            "created",
            v.created.map_or_else(|| "-".into(), |t| t.to_string()),
        ),
    ]);
    if let Some(source) = &spec.source {
        pairs.push(("source", source_text(source)));
    }
    if let Some(claim) = &spec.claim {
        pairs.push(("claim", claim_text(claim)));
    }
    if !v.adjustments.is_empty() {
        pairs.push(("adjusted", adjustments_text(&v.adjustments)));
    }
    if !v.message.is_empty() {
        pairs.push(("message", v.message.clone()));
    }
    fields(&pairs)
}

/// Settings lowered to fit the node: `queues 64 -> 4, queue depth 8192 -> 4096 (this node's
/// limits)`.
fn adjustments_text(list: &[ublkd_proto::v1::Adjustment]) -> String {
    let each: Vec<String> = list
        .iter()
        .map(|a| {
            let what = match ublkd_proto::v1::Setting::try_from(a.setting) {
                Ok(ublkd_proto::v1::Setting::Queues) => "queues".to_owned(),
                Ok(ublkd_proto::v1::Setting::QueueDepth) => "queue depth".to_owned(),
                Ok(ublkd_proto::v1::Setting::Unspecified) | Err(_) => {
                    format!("setting {}", a.setting)
                }
            };
            format!("{what} {} -> {}", a.requested, a.applied)
        })
        .collect();
    format!("{} (this node's limits)", each.join(", "))
}

/// A Kubernetes claim: `NAMESPACE/NAME (pv PV)`, what is unknown left out.
fn claim_text(c: &ublkd_proto::v1::Claim) -> String {
    let mut out = match (c.namespace.as_str(), c.name.as_str()) {
        ("", "") => String::from("-"),
        ("", name) => name.to_owned(),
        (ns, name) => format!("{ns}/{}", or_dash(name)),
    };
    if !c.persistent_volume.is_empty() {
        out.push_str(&format!(" (pv {})", c.persistent_volume));
    }
    out
}

/// What `create-volume` prints: the block device, for `dev=$(ublkctl create-volume ...)`.
pub fn device_line(v: &Volume) -> String {
    or_dash(&v.device_path)
}

fn toggle_word(t: i32) -> String {
    Toggle::try_from(t).map_or_else(
        |_| format!("unknown ({t})"),
        |t| t.as_str_name().trim_start_matches("TOGGLE_").to_lowercase(),
    )
}

/// "on"/"off" while the volume has a device, else "-".
/// Why polling is on or off, where the server says (`Volume.poll_reason`).
fn poll_reason_words(r: i32) -> Option<&'static str> {
    Some(match PollReason::try_from(r).ok()? {
        PollReason::Unspecified => return None,
        PollReason::Asked => "asked for",
        PollReason::Declined => "declined",
        PollReason::NotOffered => "the backend cannot be polled",
        PollReason::SharedCpus => "the workers' CPUs also run applications",
        PollReason::DedicatedCpus => "the workers have CPUs to themselves",
        PollReason::ZeroCopyKept => "zero copy kept (kernel before 7.1)",
    })
}

/// Where the queues are served and why (`Volume.placement`), while the volume has a device:
/// `other-cpu (queue CPUs 1,0: why)`, the CPU serving each queue by queue number.
fn placement_text(v: &Volume) -> String {
    let Ok(p) = QueuePlacement::try_from(v.placement) else {
        return format!("unknown ({})", v.placement);
    };
    if v.device_path.is_empty() || p == QueuePlacement::Unspecified {
        return "-".into();
    }
    let word = p
        .as_str_name()
        .trim_start_matches("QUEUE_PLACEMENT_")
        .to_lowercase()
        .replace('_', "-");
    let cpus: Vec<String> = v.queue_cpus.iter().map(u32::to_string).collect();
    let why = match PlacementReason::try_from(v.placement_reason) {
        Ok(PlacementReason::Asked) => "asked for",
        Ok(PlacementReason::SharedCpus) => "the workers' CPUs also run applications",
        Ok(PlacementReason::DedicatedCpus) => "the workers have CPUs to themselves",
        Ok(PlacementReason::NoWorkerFits) => "no worker fitted every queue",
        Ok(PlacementReason::Unspecified) | Err(_) => "",
    };
    match (cpus.is_empty(), why.is_empty()) {
        (true, true) => word,
        (true, false) => format!("{word} ({why})"),
        (false, true) => format!("{word} (queue CPUs {})", cpus.join(",")),
        (false, false) => format!("{word} (queue CPUs {}: {why})", cpus.join(",")),
    }
}

fn in_use(v: &Volume, on: bool) -> &'static str {
    match (v.device_path.is_empty(), on) {
        (true, _) => "-",
        (false, true) => "on",
        (false, false) => "off",
    }
}

/// A mean latency in the unit that keeps it readable.
fn latency_text(seconds: f64) -> String {
    if seconds <= 0.0 || !seconds.is_finite() {
        "-".into()
    } else if seconds < 1e-6 {
        format!("{:.0} ns", seconds * 1e9)
    } else if seconds < 1e-3 {
        format!("{:.1} µs", seconds * 1e6)
    } else if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

/// `stats` as text: a table of operations, then the volume-wide counters.
pub fn stats_text(s: &VolumeStats) -> String {
    use Align::{Left, Right};
    let rows: Vec<Vec<String>> = s
        .ops
        .iter()
        .map(|op| {
            let q = |s: f64| {
                if op.count == 0 {
                    "-".to_owned()
                } else {
                    latency_text(s)
                }
            };
            vec![
                op.op.clone(),
                op.count.to_string(),
                format_size(op.bytes),
                q(op.latency_p50_seconds),
                q(op.latency_p99_seconds),
            ]
        })
        .collect();
    let ops = table(
        &[
            ("OP", Left),
            ("COUNT", Right),
            ("BYTES", Right),
            ("P50", Right),
            ("P99", Right),
        ],
        &rows,
        true,
    );
    let mut totals = vec![
        ("errors", s.errors.to_string()),
        ("inflight", s.inflight.to_string()),
        ("memory", format_size(s.memory_bytes)),
        ("mean latency", latency_text(s.latency_mean_seconds)),
        ("throttled", throttled_text(s)),
    ];
    if s.protocol_errors > 0 {
        totals.push((
            "protocol errors",
            format!(
                "{} (last errno {})",
                s.protocol_errors, s.last_protocol_errno
            ),
        ));
    }
    let totals = fields(&totals);
    format!("volume {}\n\n{ops}\n\n{totals}", s.id)
}

/// Requests held back by the volume's limits, and how long they waited in all.
fn throttled_text(s: &VolumeStats) -> String {
    match s.throttled_requests {
        0 => "0 requests".into(),
        1 => format!("1 request, {} waited", latency_text(s.throttled_seconds)),
        n => format!("{n} requests, {} waited", latency_text(s.throttled_seconds)),
    }
}

/// CPU ids as ranges: `[0, 1, 2, 3, 8]` -> `0-3,8`.
fn cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for cpu in sorted {
        match ranges.last_mut() {
            Some((_, end)) if end.checked_add(1) == Some(cpu) => *end = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    ranges
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The kernel's last known server of an orphan; 0 (or less) when it knows none.
fn pid_text(pid: i32) -> String {
    if pid > 0 {
        pid.to_string()
    } else {
        "-".into()
    }
}

/// `4 queues`, `1 queue`.
fn queues_text(queues: u32) -> String {
    if queues == 1 {
        "1 queue".into()
    } else {
        format!("{queues} queues")
    }
}

/// `node-info` as text: one `orphan N:` line per orphan device, or `orphans: none`.
pub fn node_text(n: &NodeInfo) -> String {
    let mut features = format!("{:#x}", n.ublk_features);
    if !n.ublk_feature_names.is_empty() {
        features.push_str(&format!(" ({})", n.ublk_feature_names.join(", ")));
    }
    let mut pairs: Vec<(String, String)> = vec![
        ("version".into(), or_dash(&n.version)),
        ("kernel".into(), or_dash(&n.kernel_release)),
        ("ublk features".into(), features),
        ("worker cpus".into(), or_dash(&cpu_list(&n.worker_cpus))),
        ("backends".into(), or_dash(&n.backends.join(", "))),
        ("volumes".into(), n.volumes.to_string()),
    ];
    if !n.dataplane_error.is_empty() {
        pairs.push(("dataplane".into(), format!("none: {}", n.dataplane_error)));
    }
    if n.orphans.is_empty() {
        pairs.push(("orphans".into(), "none".into()));
    }
    for o in &n.orphans {
        pairs.push((
            format!("orphan {}", o.dev_id),
            format!(
                "{}, {}, {} x {}, server pid {}",
                or_dash(&o.state),
                format_size(o.size_bytes),
                queues_text(o.queues),
                o.queue_depth,
                pid_text(o.server_pid)
            ),
        ));
    }
    fields(&pairs)
}

fn orphan_value(o: &OrphanDevice) -> Value {
    json!({
        "dev_id": o.dev_id,
        "state": o.state,
        "server_pid": o.server_pid,
        "size_bytes": o.size_bytes,
        "queues": o.queues,
        "queue_depth": o.queue_depth,
    })
}

fn orphans_value(orphans: &[OrphanDevice]) -> Value {
    Value::Array(orphans.iter().map(orphan_value).collect())
}

/// `capacity` for people.
pub fn capacity_text(c: &Capacity) -> String {
    let mut pairs = vec![
        ("available", format_size(c.available_bytes)),
        ("largest volume", format_size(c.maximum_volume_bytes)),
        ("total", format_size(c.total_bytes)),
        ("volumes left", c.volumes_left.to_string()),
    ];
    if !c.free_extents.is_empty() {
        let extents = c
            .free_extents
            .iter()
            .map(|e| {
                format!(
                    "{}+{}",
                    compact_size(e.offset_bytes),
                    compact_size(e.length_bytes)
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        pairs.push(("free extents", extents));
    }
    fields(&pairs)
}

/// The `orphans` table, or a sentence when there are none.
pub fn orphans_table(orphans: &[OrphanDevice], without_pv: &[String], with_header: bool) -> String {
    let devices = devices_table(orphans, with_header);
    if without_pv.is_empty() {
        return devices;
    }
    let rows: Vec<Vec<String>> = without_pv.iter().map(|v| vec![v.clone()]).collect();
    let volumes = table(&[("VOLUME WITHOUT PV", Align::Left)], &rows, with_header);
    if orphans.is_empty() {
        volumes
    } else {
        format!("{devices}\n\n{volumes}")
    }
}

fn devices_table(orphans: &[OrphanDevice], with_header: bool) -> String {
    use Align::{Left, Right};
    if orphans.is_empty() {
        // Scripts asking for bare rows get none; people get a sentence.
        return if with_header {
            "no orphan ublk devices".into()
        } else {
            String::new()
        };
    }
    let rows: Vec<Vec<String>> = orphans
        .iter()
        .map(|o| {
            vec![
                o.dev_id.to_string(),
                or_dash(&o.state),
                format_size(o.size_bytes),
                o.queues.to_string(),
                o.queue_depth.to_string(),
                pid_text(o.server_pid),
            ]
        })
        .collect();
    table(
        &[
            ("DEV ID", Right),
            ("STATE", Left),
            ("SIZE", Right),
            ("QUEUES", Right),
            ("DEPTH", Right),
            ("SERVER PID", Right),
        ],
        &rows,
        with_header,
    )
}

/// `orphans` as JSON: `{"orphans": [...], "volumes_without_pv": [...]}`, the fields of
/// `NodeInfo` they come from.
pub fn orphans_json(orphans: &[OrphanDevice], without_pv: &[String]) -> String {
    pretty(&json!({ "orphans": orphans_value(orphans), "volumes_without_pv": without_pv }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use ublkd_proto::v1::VolumeSpec;

    /// What `-o json` prints for each answer (`api_json`), as these tests read it.
    fn volume_json(v: &Volume) -> String {
        crate::api_json::pretty(v, "Volume").unwrap()
    }
    fn volumes_json(volumes: &[Volume]) -> String {
        let list = ublkd_proto::v1::ListVolumesResponse {
            volumes: volumes.to_vec(),
        };
        crate::api_json::pretty(&list, "ListVolumesResponse").unwrap()
    }
    fn stats_json(s: &VolumeStats) -> String {
        crate::api_json::pretty(s, "VolumeStats").unwrap()
    }
    fn node_json(n: &NodeInfo) -> String {
        crate::api_json::pretty(n, "NodeInfo").unwrap()
    }

    #[test]
    fn tables_can_leave_out_their_header() {
        let with = volumes_table(&[sample()], true);
        let without = volumes_table(&[sample()], false);
        assert_eq!(
            with.lines().skip(1).collect::<Vec<_>>(),
            without.lines().collect::<Vec<_>>()
        );
        assert!(with.starts_with("ID"));
        assert_eq!(orphans_table(&[], &[], false), "");
    }
    use ublkd_proto::v1::{volume_spec::Source, FileBackend, OpStats, QosLimits, RamBackend};

    fn sample() -> Volume {
        let mut v = Volume {
            id: "vol-1".into(),
            spec: Some(VolumeSpec {
                size_bytes: 10 << 30,
                block_size: Some(4096),
                backend: Some(Backend::File(FileBackend {
                    path: "/srv/vol-1.img".into(),
                    create: true,
                })),
                queues: Some(4),
                queue_depth: None,
                io_path: IoPath::Auto.into(),
                zero_copy: Toggle::Auto.into(),
                poll: Toggle::Off.into(),
                qos: None,
                source: None,
                claim: None,
                fit_to_node: false,
            }),
            state: VolumeState::Ready.into(),
            device_path: "/dev/ublkb0".into(),
            dev_id: 0,
            created: None,
            io_path_in_use: IoPath::PerIo.into(),
            message: String::new(),
            zero_copy_in_use: true,
            polled: false,
            poll_reason: PollReason::Declined.into(),
            placement: QueuePlacement::OtherCpu.into(),
            placement_reason: PlacementReason::SharedCpus.into(),
            queue_cpus: vec![1, 0, 1, 0],
            adjustments: Vec::new(),
        };
        // The cli does not depend on prost-types; reach the Timestamp through the field.
        v.created.get_or_insert_with(Default::default).seconds = 1_700_000_000;
        v
    }

    #[test]
    fn volume_table_lines_up() {
        let mut ram = sample();
        ram.id = "scratch".into();
        ram.spec.as_mut().unwrap().size_bytes = 1536 << 20;
        ram.spec.as_mut().unwrap().backend = Some(Backend::Ram(RamBackend {}));
        ram.state = VolumeState::Creating.into();
        ram.device_path.clear();
        ram.io_path_in_use = IoPath::Auto.into();
        ram.spec.as_mut().unwrap().qos = Some(QosLimits {
            write_bytes_per_second: 200 << 20,
            burst_ms: 2000,
            ..QosLimits::default()
        });
        let expected = "\
ID       STATE     SIZE     BACKEND                     DEVICE       IO PATH  QOS
vol-1    ready     10 GiB   file+create:/srv/vol-1.img  /dev/ublkb0  per-io   -
scratch  creating  1.5 GiB  ram                         -            auto     write 200 MiB/s";
        assert_eq!(volumes_table(&[sample(), ram], true), expected);
    }

    #[test]
    fn an_empty_list_is_just_the_header() {
        assert_eq!(
            volumes_table(&[], true),
            "ID  STATE  SIZE  BACKEND  DEVICE  IO PATH  QOS"
        );
    }

    #[test]
    fn volume_text_shows_every_field() {
        let expected = "\
id:          vol-1
state:       ready
size:        10 GiB (10737418240 bytes)
backend:     file+create:/srv/vol-1.img
block size:  4096
queues:      4
queue depth: server default
io path:     auto (in use: per-io)
zero copy:   auto (in use: on)
poll:        off (in use: off: declined)
placement:   other-cpu (queue CPUs 1,0,1,0: the workers' CPUs also run applications)
qos:         unlimited
device:      /dev/ublkb0 (ublk id 0)
created:     2023-11-14T22:13:20Z";
        assert_eq!(volume_text(&sample()), expected);
    }

    /// An NVMe volume shows its namespace's identity, and its JSON every field of the API's
    /// NvmeBackend (keep_data was left out).
    #[test]
    fn an_nvme_volume_shows_its_namespace_identity() {
        let mut v = sample();
        v.spec.as_mut().unwrap().backend = Some(Backend::Nvme(ublkd_proto::v1::NvmeBackend {
            device: "/dev/ng1n1".into(),
            offset_bytes: Some(0),
            length_bytes: 1 << 30,
            keep_data: true,
            identity: "eui.0011223344556677".into(),
        }));
        assert!(
            volume_text(&v).contains("namespace:   eui.0011223344556677"),
            "{}",
            volume_text(&v)
        );
        let json: Value = serde_json::from_str(&volume_json(&v)).unwrap();
        let nvme = &json["spec"]["nvme"];
        assert_eq!(nvme["identity"], "eui.0011223344556677", "{json}");
        assert_eq!(nvme["keep_data"], true, "{json}");
    }

    #[test]
    fn volume_text_shows_limits_and_source() {
        let mut v = sample();
        let spec = v.spec.as_mut().unwrap();
        spec.qos = Some(QosLimits {
            read_iops: 5000,
            write_bytes_per_second: 200 << 20,
            ..QosLimits::default()
        });
        spec.source = Some(Source::FromSnapshot("db-monday".into()));
        let text = volume_text(&v);
        assert!(
            text.contains("\nqos:         read 5000 IOPS, write 200 MiB/s, burst 100 ms\n"),
            "{text}"
        );
        assert!(
            text.ends_with("\nsource:      snapshot db-monday"),
            "{text}"
        );
        let j: Value = serde_json::from_str(&volume_json(&v)).unwrap();
        assert_eq!(j["spec"]["qos"]["read_iops"], 5000);
        assert_eq!(j["spec"]["qos"]["write_bytes_per_second"], 200u64 << 20);
        assert_eq!(j["spec"]["qos"]["burst_ms"], 0);
        assert_eq!(j["spec"]["from_snapshot"], "db-monday");
        assert!(j["spec"].get("from_volume").is_none());
        assert!(j["spec"].get("claim").is_none());
    }

    #[test]
    fn volume_text_and_json_show_the_claim() {
        let mut v = sample();
        v.spec.as_mut().unwrap().claim = Some(ublkd_proto::v1::Claim {
            namespace: "shop".into(),
            name: "data-db-0".into(),
            persistent_volume: "pvc-1234".into(),
        });
        let text = volume_text(&v);
        assert!(
            text.ends_with("\nclaim:       shop/data-db-0 (pv pvc-1234)"),
            "{text}"
        );
        v.adjustments = vec![ublkd_proto::v1::Adjustment {
            setting: ublkd_proto::v1::Setting::Queues as i32,
            requested: 64,
            applied: 2,
        }];
        assert!(
            volume_text(&v).ends_with("\nadjusted:    queues 64 -> 2 (this node's limits)"),
            "{}",
            volume_text(&v)
        );
        let j: Value = serde_json::from_str(&volume_json(&v)).unwrap();
        assert_eq!(j["adjustments"][0]["setting"], "SETTING_QUEUES");
        assert_eq!(j["adjustments"][0]["requested"], 64);
        assert_eq!(j["spec"]["claim"]["name"], "data-db-0");
        assert_eq!(j["spec"]["claim"]["namespace"], "shop");
        assert_eq!(j["spec"]["claim"]["persistent_volume"], "pvc-1234");
    }

    #[test]
    fn volume_json_uses_proto_field_names() {
        let v: Value = serde_json::from_str(&volume_json(&sample())).unwrap();
        assert_eq!(
            v,
            json!({
                "id": "vol-1",
                "spec": {
                    "size_bytes": 10u64 << 30,
                    "block_size": 4096,
                    "file": { "path": "/srv/vol-1.img", "create": true },
                    "queues": 4,
                    "io_path": "IO_PATH_AUTO",
                    "zero_copy": "TOGGLE_AUTO",
                    "poll": "TOGGLE_OFF",
                    // left out by the hand-written JSON before it was the message serialised
                    "fit_to_node": false,
                },
                "state": "VOLUME_STATE_READY",
                "device_path": "/dev/ublkb0",
                "dev_id": 0,
                "created": "2023-11-14T22:13:20Z",
                "io_path_in_use": "IO_PATH_PER_IO",
                "zero_copy_in_use": true,
                "polled": false,
                "poll_reason": "POLL_REASON_DECLINED",
                "placement": "QUEUE_PLACEMENT_OTHER_CPU",
                "placement_reason": "PLACEMENT_REASON_SHARED_CPUS",
                "queue_cpus": [1, 0, 1, 0],
                "adjustments": [],
                "message": "",
            })
        );
        let list: Value = serde_json::from_str(&volumes_json(&[sample()])).unwrap();
        assert_eq!(list["volumes"][0]["id"], "vol-1");
    }

    #[test]
    fn unknown_enum_values_stay_visible() {
        let mut v = sample();
        v.state = 42;
        assert!(volumes_table(&[v.clone()], true).contains(" 42 "));
        let j: Value = serde_json::from_str(&volume_json(&v)).unwrap();
        assert_eq!(j["state"], 42);
    }

    #[test]
    fn stats_render() {
        let stats = VolumeStats {
            id: "vol-1".into(),
            ops: vec![
                OpStats {
                    op: "read".into(),
                    count: 1200,
                    bytes: 4800 << 10,
                    latency_p50_seconds: 0.000_02,
                    latency_p99_seconds: 0.0021,
                },
                OpStats {
                    op: "flush".into(),
                    count: 3,
                    bytes: 0,
                    latency_p50_seconds: 0.000_5,
                    latency_p99_seconds: 0.000_9,
                },
                OpStats {
                    op: "discard".into(),
                    count: 0,
                    bytes: 0,
                    latency_p50_seconds: 0.0,
                    latency_p99_seconds: 0.0,
                },
            ],
            errors: 1,
            inflight: 2,
            memory_bytes: 0,
            latency_mean_seconds: 0.000_042_5,
            throttled_requests: 12,
            throttled_seconds: 0.35,
            protocol_errors: 0,
            last_protocol_errno: 0,
        };
        let expected = "\
volume vol-1

OP       COUNT    BYTES       P50       P99
read      1200  4.7 MiB   20.0 µs    2.1 ms
flush        3      0 B  500.0 µs  900.0 µs
discard      0      0 B         -         -

errors:       1
inflight:     2
memory:       0 B
mean latency: 42.5 µs
throttled:    12 requests, 350.0 ms waited";
        assert_eq!(stats_text(&stats), expected);
        let once = VolumeStats {
            throttled_requests: 1,
            throttled_seconds: 2.0,
            ..stats.clone()
        };
        assert!(stats_text(&once).ends_with("throttled:    1 request, 2.00 s waited"));
        let never = VolumeStats {
            throttled_requests: 0,
            throttled_seconds: 0.0,
            ..stats.clone()
        };
        assert!(stats_text(&never).ends_with("throttled:    0 requests"));
        let broken = VolumeStats {
            protocol_errors: 2,
            last_protocol_errno: 5,
            ..stats.clone()
        };
        assert!(stats_text(&broken).ends_with("protocol errors: 2 (last errno 5)"));
        let j: Value = serde_json::from_str(&stats_json(&stats)).unwrap();
        assert_eq!(j["ops"][0]["bytes"], 4800 << 10);
        assert_eq!(j["ops"][0]["latency_p99_seconds"], 0.0021);
        assert_eq!(j["latency_mean_seconds"], 0.000_042_5);
        assert_eq!(j["throttled_requests"], 12);
        assert_eq!(j["throttled_seconds"], 0.35);
    }

    #[test]
    fn node_info_renders() {
        let node = NodeInfo {
            version: "0.1.0".into(),
            kernel_release: "7.1.0-1-amd64".into(),
            ublk_features: 0x42,
            ublk_feature_names: vec!["ZERO_COPY".into(), "BATCH_IO".into()],
            worker_cpus: vec![3, 0, 1, 2, 8],
            backends: vec!["null".into(), "ram".into(), "file".into()],
            volumes: 2,
            orphans: Vec::new(),
            volumes_without_pv: Vec::new(),
            dataplane_error: String::new(),
        };
        let expected = "\
version:       0.1.0
kernel:        7.1.0-1-amd64
ublk features: 0x42 (ZERO_COPY, BATCH_IO)
worker cpus:   0-3,8
backends:      null, ram, file
volumes:       2
orphans:       none";
        assert_eq!(node_text(&node), expected);
        let j: Value = serde_json::from_str(&node_json(&node)).unwrap();
        assert_eq!(j["worker_cpus"], json!([3, 0, 1, 2, 8]));
        assert_eq!(j["orphans"], json!([]));
    }

    fn orphans() -> Vec<OrphanDevice> {
        vec![
            OrphanDevice {
                dev_id: 3,
                state: "quiesced".into(),
                server_pid: 4242,
                size_bytes: 10 << 30,
                queues: 4,
                queue_depth: 128,
            },
            OrphanDevice {
                dev_id: 12,
                state: "dead".into(),
                server_pid: 0,
                size_bytes: 1536 << 20,
                queues: 1,
                queue_depth: 64,
            },
        ]
    }

    #[test]
    fn node_info_lists_orphans_a_line_each() {
        let node = NodeInfo {
            version: "0.1.0".into(),
            volumes: 1,
            orphans: orphans(),
            ..NodeInfo::default()
        };
        let expected = "\
version:       0.1.0
kernel:        -
ublk features: 0x0
worker cpus:   -
backends:      -
volumes:       1
orphan 3:      quiesced, 10 GiB, 4 queues x 128, server pid 4242
orphan 12:     dead, 1.5 GiB, 1 queue x 64, server pid -";
        assert_eq!(node_text(&node), expected);
        let j: Value = serde_json::from_str(&node_json(&node)).unwrap();
        assert_eq!(j["orphans"][1]["dev_id"], 12);
        assert_eq!(j["orphans"][0]["size_bytes"], 10u64 << 30);
    }

    #[test]
    fn orphans_table_lines_up() {
        let expected = "\
DEV ID  STATE        SIZE  QUEUES  DEPTH  SERVER PID
     3  quiesced   10 GiB       4    128        4242
    12  dead      1.5 GiB       1     64           -";
        assert_eq!(orphans_table(&orphans(), &[], true), expected);
        assert_eq!(orphans_table(&[], &[], true), "no orphan ublk devices");
        let lost = ["lost-vol".to_owned()];
        assert_eq!(
            orphans_table(&orphans(), &lost, true),
            format!("{expected}\n\nVOLUME WITHOUT PV\nlost-vol")
        );
        assert_eq!(
            orphans_table(&[], &lost, true),
            "VOLUME WITHOUT PV\nlost-vol"
        );
        assert_eq!(orphans_table(&[], &lost, false), "lost-vol");
    }

    #[test]
    fn orphans_json_uses_proto_field_names() {
        let j: Value = serde_json::from_str(&orphans_json(&orphans(), &[])).unwrap();
        assert_eq!(
            j["orphans"][0],
            json!({
                "dev_id": 3,
                "state": "quiesced",
                "server_pid": 4242,
                "size_bytes": 10u64 << 30,
                "queues": 4,
                "queue_depth": 128,
            })
        );
        assert_eq!(j["orphans"][1]["server_pid"], 0);
        let empty: Value = serde_json::from_str(&orphans_json(&[], &[])).unwrap();
        assert_eq!(empty, json!({ "orphans": [], "volumes_without_pv": [] }));
        let lost: Value = serde_json::from_str(&orphans_json(&[], &["lost-vol".into()])).unwrap();
        assert_eq!(lost["volumes_without_pv"], json!(["lost-vol"]));
    }

    #[test]
    fn latencies_pick_a_readable_unit() {
        assert_eq!(latency_text(0.0), "-");
        assert_eq!(latency_text(2.5e-7), "250 ns");
        assert_eq!(latency_text(0.0123), "12.3 ms");
        assert_eq!(latency_text(3.0), "3.00 s");
    }
}
