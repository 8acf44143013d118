//! A volume's I/O limits as Kubernetes names them: StorageClass parameters give a new volume its
//! limits, and a VolumeAttributesClass's parameters (CSI `mutable_parameters`, at CreateVolume
//! and ControllerModifyVolume) change them later. ublkd enforces them (`QosLimits`).
//!
//! | key | values | |
//! |---|---|---|
//! | `readIops`, `writeIops` | a whole number of I/Os per second | `0` or `unlimited`: no limit |
//! | `readBandwidth`, `writeBandwidth` | bytes per second: `200Mi`, `200MiB/s`, `1G/s` | `0` or `unlimited`: no limit |
//! | `qosBurst` | how long an idle volume may then run above its limits: `100ms`, `2s`, at most `60s` | `0` or `default`: ublkd's 100 ms |
//!
//! A change sets only the keys it names (the CSI spec: "SPs MUST NOT modify volumes based on the
//! absence of keys"); `0` clears a limit.

use crate::error::CsiError;
use std::collections::HashMap;
use ublkd_client::units::parse_rate;
use ublkd_client::v1;

/// Every QoS key, as StorageClasses and VolumeAttributesClasses spell them.
pub const KEYS: [&str; 5] = [
    "readIops",
    "writeIops",
    "readBandwidth",
    "writeBandwidth",
    "qosBurst",
];

/// The most burst ublkd accepts (`QosLimits.burst_ms`).
pub const MAX_BURST_MS: u32 = 60_000;

/// Keys the sidecars add (`--extra-create-metadata`, `--extra-modify-metadata`): never ours.
pub fn is_sidecar_key(key: &str) -> bool {
    key.starts_with("csi.storage.k8s.io/")
}

/// What a set of parameters says of the limits: each `Some` sets its limit (0: none, or for
/// the burst ublkd's default); `None` leaves the limit as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosChange {
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub read_bytes_per_second: Option<u64>,
    pub write_bytes_per_second: Option<u64>,
    pub burst_ms: Option<u32>,
}

fn bad(key: &str, v: &str, want: &str) -> CsiError {
    CsiError::BadParameter(format!("parameter {key}={v:?}: expected {want}"))
}

fn iops(key: &str, v: &str) -> Result<u64, CsiError> {
    match v.trim() {
        "unlimited" => Ok(0),
        n => n
            .parse::<u64>()
            .map_err(|_| bad(key, v, "a whole number of I/Os per second, or unlimited")),
    }
}

fn bandwidth(key: &str, v: &str) -> Result<u64, CsiError> {
    match v.trim() {
        "unlimited" => Ok(0),
        r => parse_rate(r).ok_or_else(|| {
            bad(
                key,
                v,
                "bytes per second such as 200Mi, 200MiB/s or 1G/s, or unlimited",
            )
        }),
    }
}

fn burst(key: &str, v: &str) -> Result<u32, CsiError> {
    let want = "a duration such as 100ms or 2s (at most 60s), or default";
    let v = v.trim();
    let ms = match v {
        "0" | "default" => Some(0),
        _ => v
            .strip_suffix("ms")
            .and_then(|n| n.parse::<u64>().ok())
            .or_else(|| {
                v.strip_suffix('s')
                    .and_then(|n| n.parse::<u64>().ok())
                    .and_then(|s| s.checked_mul(1000))
            }),
    };
    ms.filter(|&ms| ms <= u64::from(MAX_BURST_MS))
        .and_then(|ms| u32::try_from(ms).ok())
        .ok_or_else(|| bad(key, v, want))
}

impl QosChange {
    /// The QoS keys among `params`; other keys are the caller's to check.
    pub fn from_params(params: &HashMap<String, String>) -> Result<Self, CsiError> {
        let mut c = QosChange::default();
        for (k, v) in params {
            match k.as_str() {
                "readIops" => c.read_iops = Some(iops(k, v)?),
                "writeIops" => c.write_iops = Some(iops(k, v)?),
                "readBandwidth" => c.read_bytes_per_second = Some(bandwidth(k, v)?),
                "writeBandwidth" => c.write_bytes_per_second = Some(bandwidth(k, v)?),
                "qosBurst" => c.burst_ms = Some(burst(k, v)?),
                _ => {}
            }
        }
        Ok(c)
    }

    /// A VolumeAttributesClass's parameters: QoS keys only (the sidecars' own keys aside), so
    /// that a class naming anything else is refused before anything changes.
    pub fn from_mutable(params: &HashMap<String, String>) -> Result<Self, CsiError> {
        if let Some(k) = params
            .keys()
            .find(|k| !KEYS.contains(&k.as_str()) && !is_sidecar_key(k))
        {
            return Err(CsiError::BadParameter(format!(
                "mutable parameter {k:?} cannot be changed: a volume's mutable parameters are \
                 its I/O limits ({})",
                KEYS.join(", ")
            )));
        }
        Self::from_params(params)
    }

    pub fn is_empty(&self) -> bool {
        *self == QosChange::default()
    }

    /// `base` with this change made.
    pub fn apply(&self, base: &v1::QosLimits) -> v1::QosLimits {
        v1::QosLimits {
            read_iops: self.read_iops.unwrap_or(base.read_iops),
            write_iops: self.write_iops.unwrap_or(base.write_iops),
            read_bytes_per_second: self
                .read_bytes_per_second
                .unwrap_or(base.read_bytes_per_second),
            write_bytes_per_second: self
                .write_bytes_per_second
                .unwrap_or(base.write_bytes_per_second),
            burst_ms: self.burst_ms.unwrap_or(base.burst_ms),
        }
    }
}

/// The limits as a VolumeSpec carries them: unset when nothing is limited and the burst is the
/// default (what ublkd reports for such a volume).
pub fn spec_limits(q: v1::QosLimits) -> Option<v1::QosLimits> {
    (q != v1::QosLimits::default()).then_some(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn limits_are_read_in_kubernetes_units() {
        let c = QosChange::from_params(&map(&[
            ("readIops", "2000"),
            ("writeIops", "unlimited"),
            ("readBandwidth", "200Mi"),
            ("writeBandwidth", "1G/s"),
            ("qosBurst", "250ms"),
            ("backend", "file"),
        ]))
        .unwrap();
        assert_eq!(
            c,
            QosChange {
                read_iops: Some(2000),
                write_iops: Some(0),
                read_bytes_per_second: Some(200 << 20),
                write_bytes_per_second: Some(1_000_000_000),
                burst_ms: Some(250),
            }
        );
        let rate = |v| {
            QosChange::from_params(&map(&[("readBandwidth", v)]))
                .unwrap()
                .read_bytes_per_second
        };
        assert_eq!(rate("200MiB/s"), Some(200 << 20));
        assert_eq!(rate("0"), Some(0));
        let burst = |v| QosChange::from_params(&map(&[("qosBurst", v)])).map(|c| c.burst_ms);
        assert_eq!(burst("2s").unwrap(), Some(2000));
        assert_eq!(burst("60s").unwrap(), Some(MAX_BURST_MS));
        assert_eq!(burst("default").unwrap(), Some(0));
        for (k, v) in [
            ("readIops", "-1"),
            ("readIops", "1.5"),
            ("writeIops", "10k"),
            ("readBandwidth", "fast"),
            ("writeBandwidth", "10m"),
            ("qosBurst", "61s"),
            ("qosBurst", "100"),
            ("qosBurst", "1h"),
        ] {
            let e = QosChange::from_params(&map(&[(k, v)])).expect_err(v);
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{k}={v}: {e}");
            assert!(e.to_string().contains(k), "{e}");
        }
    }

    #[test]
    fn a_change_sets_only_the_keys_it_names_and_zero_clears() {
        let base = v1::QosLimits {
            read_iops: 1000,
            write_iops: 500,
            read_bytes_per_second: 100 << 20,
            write_bytes_per_second: 50 << 20,
            burst_ms: 300,
        };
        let c = QosChange::from_mutable(&map(&[
            ("writeIops", "800"),
            ("readBandwidth", "unlimited"),
            ("qosBurst", "0"),
        ]))
        .unwrap();
        assert_eq!(
            c.apply(&base),
            v1::QosLimits {
                read_iops: 1000,
                write_iops: 800,
                read_bytes_per_second: 0,
                write_bytes_per_second: 50 << 20,
                burst_ms: 0,
            }
        );
        let none = QosChange::from_mutable(&HashMap::new()).unwrap();
        assert!(none.is_empty());
        assert_eq!(none.apply(&base), base, "no key, no change");
        assert_eq!(spec_limits(v1::QosLimits::default()), None);
        assert_eq!(spec_limits(base), Some(base));
    }

    #[test]
    fn mutable_parameters_are_qos_keys_only() {
        let e = QosChange::from_mutable(&map(&[("XXX_FakeKey", "XXX_FakeValue")]))
            .expect_err("unknown key");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.to_string().contains("XXX_FakeKey"), "{e}");
        let e = QosChange::from_mutable(&map(&[("backend", "ram")])).expect_err("not mutable");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let c = QosChange::from_mutable(&map(&[
            ("readIops", "10"),
            ("csi.storage.k8s.io/pvc/name", "data"),
        ]))
        .unwrap();
        assert_eq!(c.read_iops, Some(10));
    }
}
