//! The API's calls: how many ended with each status code and how long each took, per method.
//! The methods are a fixed table read at start from the API's own descriptors, so a client
//! that names a method the API does not have is counted under `other` and cannot grow the
//! label set. Handling times are the dataplane's [`Histogram`], as every other histogram the
//! server exports.

use super::text::{family, Kind};
use prost::Message;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use ublkd_dataplane::stats::Histogram;

/// Upper bounds of the handling-time buckets: 1 ms to 30 s.
const BOUNDS_NS: [u64; 10] = [
    1_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
];

/// The gRPC status codes, in their wire order (`tonic::Code as usize` indexes it).
const CODES: [tonic::Code; 17] = {
    use tonic::Code::*;
    [
        Ok,
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    ]
};

/// The label a method the API does not have is counted under.
const OTHER: &str = "other";

/// One method's counts.
#[derive(Debug, Default)]
struct Row {
    codes: [AtomicU64; CODES.len()],
    duration: Histogram<{ BOUNDS_NS.len() + 1 }>,
}

/// Every API method's counts, and `other`'s last.
#[derive(Debug)]
pub struct Rpcs {
    /// The API's method names, sorted; `rows[i]` is `methods[i]`'s.
    methods: Vec<String>,
    rows: Vec<Row>,
}

/// Reading the API's descriptors failed.
#[derive(Debug, thiserror::Error)]
#[error("decoding the API's descriptors: {0}")]
pub struct DecodeDescriptors(#[from] prost::DecodeError);

impl Rpcs {
    /// A table for the methods of every service in `descriptors` (an encoded
    /// `FileDescriptorSet`).
    pub fn new(descriptors: &[u8]) -> Result<Self, DecodeDescriptors> {
        let set = prost_types::FileDescriptorSet::decode(descriptors)?;
        let mut methods: Vec<String> = set
            .file
            .iter()
            .flat_map(|f| &f.service)
            .flat_map(|s| &s.method)
            .filter_map(|m| m.name.clone())
            .collect();
        methods.sort();
        methods.dedup();
        let rows = (0..=methods.len()).map(|_| Row::default()).collect();
        Ok(Self { methods, rows })
    }

    fn row(&self, method: &str) -> &Row {
        let i = self
            .methods
            .binary_search_by(|m| m.as_str().cmp(method))
            .unwrap_or(self.methods.len());
        &self.rows[i]
    }

    /// Counts one finished call.
    pub fn record(&self, method: &str, code: tonic::Code, took: Duration) {
        let row = self.row(method);
        row.codes[code as usize].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        row.duration.observe_shared(&BOUNDS_NS, ns);
    }

    /// `ublkd_grpc_requests_total` and `ublkd_grpc_request_duration_seconds`, with a series
    /// for each method and code that has been seen.
    pub fn write(&self, out: &mut String) {
        let names = self
            .methods
            .iter()
            .map(String::as_str)
            .chain([OTHER])
            .zip(&self.rows);
        family(
            out,
            "ublkd_grpc_requests_total",
            "gRPC requests by method and status code",
            Kind::Counter,
            |f| {
                for (method, row) in names.clone() {
                    for (code, n) in CODES.iter().zip(&row.codes) {
                        let n = n.load(Ordering::Relaxed);
                        if n > 0 {
                            f.counter(&[("method", method), ("code", code_name(*code))], n as f64);
                        }
                    }
                }
            },
        );
        let bounds = BOUNDS_NS.map(|ns| ns as f64 / 1e9);
        family(
            out,
            "ublkd_grpc_request_duration_seconds",
            "gRPC request handling time by method",
            Kind::Histogram,
            |f| {
                for (method, row) in names {
                    let (counts, sum_ns) = row.duration.load();
                    if counts.iter().any(|&c| c > 0) {
                        f.histogram(&[("method", method)], &bounds, &counts, sum_ns as f64 / 1e9);
                    }
                }
            },
        );
    }
}

/// A code's name as gRPC spells it.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rpcs() -> Rpcs {
        Rpcs::new(ublkd_proto::FILE_DESCRIPTOR_SET).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn the_table_holds_the_apis_methods_and_other() {
        let r = rpcs();
        for m in [
            "CreateVolume",
            "GetNodeInfo",
            "GetCapacity",
            "ListSnapshots",
        ] {
            assert!(r.methods.iter().any(|x| x == m), "{m} in {:?}", r.methods);
        }
        assert_eq!(r.rows.len(), r.methods.len() + 1);
        for (i, code) in CODES.iter().enumerate() {
            assert_eq!(*code as usize, i, "{code:?} indexes its own slot");
        }
    }

    #[test]
    fn calls_are_counted_per_method_and_code_and_unknown_methods_as_other() {
        let r = rpcs();
        r.record("CreateVolume", tonic::Code::Ok, Duration::from_millis(3));
        r.record("CreateVolume", tonic::Code::Ok, Duration::from_secs(2));
        r.record(
            "CreateVolume",
            tonic::Code::InvalidArgument,
            Duration::from_micros(10),
        );
        for junk in ["NoSuchMethod", "x", "CreateVolumeX"] {
            r.record(junk, tonic::Code::Unimplemented, Duration::from_micros(5));
        }
        let mut out = String::new();
        r.write(&mut out);
        let has = |line: &str| {
            assert!(
                out.lines().any(|l| l == line),
                "missing {line:?} in:\n{out}"
            )
        };
        has("ublkd_grpc_requests_total{method=\"CreateVolume\",code=\"OK\"} 2");
        has("ublkd_grpc_requests_total{method=\"CreateVolume\",code=\"INVALID_ARGUMENT\"} 1");
        has("ublkd_grpc_requests_total{method=\"other\",code=\"UNIMPLEMENTED\"} 3");
        has("ublkd_grpc_request_duration_seconds_bucket{method=\"CreateVolume\",le=\"0.001\"} 1");
        has("ublkd_grpc_request_duration_seconds_bucket{method=\"CreateVolume\",le=\"0.005\"} 2");
        has("ublkd_grpc_request_duration_seconds_bucket{method=\"CreateVolume\",le=\"5\"} 3");
        has("ublkd_grpc_request_duration_seconds_count{method=\"CreateVolume\"} 3");
        has("ublkd_grpc_request_duration_seconds_sum{method=\"CreateVolume\"} 2.00301");
        assert!(
            !out.contains("NoSuchMethod"),
            "no label for a method the API lacks"
        );
        assert!(
            !out.contains("method=\"GetVolume\""),
            "no series for a method never called"
        );
    }
}
