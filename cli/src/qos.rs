//! Per-volume I/O limits on the command line: the `--read-iops`, `--write-iops`, `--read-bw`,
//! `--write-bw` and `--burst` flags that `create-volume`, `adopt-device` and `set-qos` share, the
//! merge `set-qos` makes over a volume's current limits, and how limits read as text and JSON.
//! No I/O happens here.
//!
//! In the API 0 is "unlimited" (and a burst of 0 the daemon's 100 ms), so a flag given as `0` or
//! `unlimited` removes its limit, while a flag not given leaves it as it was.

use clap::{ArgGroup, Args};
use ublkd_proto::units::{format_size, parse_rate};
use ublkd_proto::v1::{QosLimits, SetVolumeQosRequest};

const IOPS_HINT: &str = "expected requests per second such as 5000, or unlimited (or 0)";
const RATE_HINT: &str =
    "expected bytes per second such as 200MiB/s, 200Mi or 1G/s, or unlimited (or 0)";
const BURST_HINT: &str =
    "expected a duration such as 100ms or 2s, at most 60s; or default (or 0) for 100 ms";

/// The daemon's burst when a volume asks for none (`QosLimits.burst_ms` 0).
const DEFAULT_BURST_MS: u32 = 100;
/// The largest burst the API takes.
const MAX_BURST_MS: u32 = 60_000;
/// Below one 4 KiB block per second a rate is a slip of the keyboard (`--write-bw 200`), not
/// a limit anyone wants: no write would ever finish in time.
const MIN_RATE: u64 = 4096;

/// The limit flags. Each is `None` when not given (unlimited for a new volume, unchanged for
/// `set-qos`); `Some(0)` is no limit.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "I/O limits")]
pub struct QosArgs {
    /// Most read requests per second; 0 or unlimited: no limit
    #[arg(long, value_name = "N", value_parser = parse_iops)]
    pub read_iops: Option<u64>,

    /// Most write, discard and write-zeroes requests per second; 0 or unlimited: no limit
    #[arg(long, value_name = "N", value_parser = parse_iops)]
    pub write_iops: Option<u64>,

    /// Most bytes read per second: 200MiB/s, 200Mi, 1G/s; 0 or unlimited: no limit
    #[arg(long, value_name = "RATE", value_parser = parse_rate_arg)]
    pub read_bw: Option<u64>,

    /// Most bytes written per second: 200MiB/s, 200Mi, 1G/s; 0 or unlimited: no limit
    #[arg(long, value_name = "RATE", value_parser = parse_rate_arg)]
    pub write_bw: Option<u64>,

    /// How long an idle volume may then run above its limits: 100ms, 2s (at most 60s);
    /// default or 0: the daemon's 100 ms
    #[arg(long, value_name = "DURATION", value_parser = parse_burst)]
    pub burst: Option<u32>,
}

impl QosArgs {
    /// `base` with each given flag's field replaced.
    pub fn over(&self, base: QosLimits) -> QosLimits {
        QosLimits {
            read_iops: self.read_iops.unwrap_or(base.read_iops),
            write_iops: self.write_iops.unwrap_or(base.write_iops),
            read_bytes_per_second: self.read_bw.unwrap_or(base.read_bytes_per_second),
            write_bytes_per_second: self.write_bw.unwrap_or(base.write_bytes_per_second),
            burst_ms: self.burst.unwrap_or(base.burst_ms),
        }
    }

    /// The limits of a new volume; `None` (unlimited) unless a flag sets one.
    pub fn to_limits(&self) -> Option<QosLimits> {
        set_or_none(self.over(QosLimits::default()))
    }
}

/// `None` for limits that are all the API's defaults, as the daemon itself reports them.
pub fn set_or_none(q: QosLimits) -> Option<QosLimits> {
    (q != QosLimits::default()).then_some(q)
}

/// Arguments of `set-qos`. At least one limit flag or `--clear`: a bare `set-qos NAME` would
/// change nothing, and is a usage error rather than a silent no-op.
#[derive(Debug, Args)]
#[command(group(
    ArgGroup::new("change")
        .required(true)
        .multiple(true)
        .args(["read_iops", "write_iops", "read_bw", "write_bw", "burst", "clear"]),
))]
pub struct SetQos {
    /// Volume id
    pub name: String,

    #[command(flatten)]
    pub limits: QosArgs,

    /// Remove every limit and the burst; limit flags given with it are then the whole set
    #[arg(long)]
    pub clear: bool,
}

impl SetQos {
    /// The request that changes `current`, the volume's limits as GetVolume returned them, by
    /// these flags. The API replaces the whole set, so what is not given is sent as it was
    /// (another client's change between the read and this call is overwritten).
    pub fn to_request(&self, current: Option<QosLimits>) -> SetVolumeQosRequest {
        let base = if self.clear {
            QosLimits::default()
        } else {
            current.unwrap_or_default()
        };
        SetVolumeQosRequest {
            id: self.name.clone(),
            qos: set_or_none(self.limits.over(base)),
        }
    }
}

fn is_unlimited(s: &str) -> bool {
    s.eq_ignore_ascii_case("unlimited")
}

/// `--read-iops`, `--write-iops`: a plain decimal count, or `unlimited` (0).
pub fn parse_iops(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if is_unlimited(s) {
        return Ok(0);
    }
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(IOPS_HINT.to_owned());
    }
    s.parse()
        .map_err(|_| format!("{IOPS_HINT}; {s} is too large"))
}

/// `--read-bw`, `--write-bw`: a rate as [`parse_rate`] reads it, or `unlimited` (0).
pub fn parse_rate_arg(s: &str) -> Result<u64, String> {
    let s = s.trim();
    if is_unlimited(s) {
        return Ok(0);
    }
    match parse_rate(s) {
        None => Err(RATE_HINT.to_owned()),
        Some(n) if n > 0 && n < MIN_RATE => Err(format!(
            "{s} is only {n} bytes per second, less than one 4 KiB block; rates take units: \
             200MiB/s, 1G/s"
        )),
        Some(n) => Ok(n),
    }
}

/// `--burst`: `100ms`, `2s`, `1.5s` in whole milliseconds up to 60 s; `default` or any zero
/// for the daemon's 100 ms (0 in the API).
pub fn parse_burst(s: &str) -> Result<u32, String> {
    let s = s.trim();
    if s == "0" || s.eq_ignore_ascii_case("default") {
        return Ok(0);
    }
    let (num, ms_per_unit, frac_digits) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1, 0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000, 3)
    } else {
        return Err(BURST_HINT.to_owned());
    };
    let num = num.trim();
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(frac) {
        return Err(BURST_HINT.to_owned());
    }
    let frac = frac.trim_end_matches('0');
    if frac.len() > frac_digits {
        return Err(format!("burst {s}: give whole milliseconds"));
    }
    // "1.5" seconds: 1 * 1000 + "500" ms.
    let frac_ms: u64 = format!("{frac:0<frac_digits$}").parse().unwrap_or(0);
    let ms = whole
        .parse::<u64>()
        .ok()
        .and_then(|w| w.checked_mul(ms_per_unit))
        .and_then(|w| w.checked_add(frac_ms));
    match ms {
        Some(ms) if ms <= u64::from(MAX_BURST_MS) => Ok(u32::try_from(ms).unwrap_or(MAX_BURST_MS)),
        _ => Err(format!(
            "burst {s} is longer than the 60s the daemon allows"
        )),
    }
}

/// A rate for people: `200 MiB/s`.
fn rate_text(bytes_per_second: u64) -> String {
    format!("{}/s", format_size(bytes_per_second))
}

/// A burst for people; 0 is the daemon's default, shown as what it is.
fn burst_text(ms: u32) -> String {
    let ms = if ms == 0 { DEFAULT_BURST_MS } else { ms };
    if ms % 1000 == 0 {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// One direction's limits: `read 5000 IOPS`, `write 200 MiB/s`, `read 5000 IOPS and 1 GiB/s`.
fn direction(name: &str, iops: u64, bytes_per_second: u64) -> Option<String> {
    match (iops, bytes_per_second) {
        (0, 0) => None,
        (n, 0) => Some(format!("{name} {n} IOPS")),
        (0, b) => Some(format!("{name} {}", rate_text(b))),
        (n, b) => Some(format!("{name} {n} IOPS and {}", rate_text(b))),
    }
}

fn directions(q: &QosLimits) -> Vec<String> {
    [
        direction("read", q.read_iops, q.read_bytes_per_second),
        direction("write", q.write_iops, q.write_bytes_per_second),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The `qos` line of `get-volume`: `read 5000 IOPS, write 200 MiB/s, burst 100 ms`, or
/// `unlimited` (with the burst only where one was asked for).
pub fn limits_text(q: Option<&QosLimits>) -> String {
    let q = q.copied().unwrap_or_default();
    let mut parts = directions(&q);
    let limited = !parts.is_empty();
    if !limited {
        parts.push("unlimited".into());
    }
    if limited || q.burst_ms != 0 {
        parts.push(format!("burst {}", burst_text(q.burst_ms)));
    }
    parts.join(", ")
}

/// The `QOS` cell of `list-volumes`: the limits without the burst, or `-`.
pub fn limits_cell(q: Option<&QosLimits>) -> String {
    let parts = q.map(directions).unwrap_or_default();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::args::{Call, Cli, Command};
    use clap::Parser;
    use serde_json::json;

    const MIB: u64 = 1 << 20;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("ublkctl").chain(args.iter().copied()))
    }

    fn set_qos(args: &[&str]) -> Result<SetQos, clap::Error> {
        let mut all = vec!["set-qos"];
        all.extend_from_slice(args);
        match parse(&all)?.command {
            Command::Call(Call::SetQos(s)) => Ok(s),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn limits(read_iops: u64, write_iops: u64, read: u64, write: u64, burst: u32) -> QosLimits {
        QosLimits {
            read_iops,
            write_iops,
            read_bytes_per_second: read,
            write_bytes_per_second: write,
            burst_ms: burst,
        }
    }

    #[test]
    fn iops_are_counts_or_unlimited() {
        assert_eq!(parse_iops("5000"), Ok(5000));
        assert_eq!(parse_iops(" 1 "), Ok(1));
        assert_eq!(parse_iops("0"), Ok(0));
        assert_eq!(parse_iops("unlimited"), Ok(0));
        assert_eq!(parse_iops("Unlimited"), Ok(0));
        for bad in ["", "-5", "5k", "1.5", "lots"] {
            assert_eq!(parse_iops(bad), Err(IOPS_HINT.to_owned()), "{bad:?}");
        }
        assert!(parse_iops("18446744073709551616")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn rates_read_binary_and_decimal_units_with_or_without_per_second() {
        assert_eq!(parse_rate_arg("200MiB/s"), Ok(200 * MIB));
        assert_eq!(parse_rate_arg("200Mi"), Ok(200 * MIB));
        assert_eq!(parse_rate_arg("1G/s"), Ok(1_000_000_000));
        assert_eq!(parse_rate_arg("4096"), Ok(4096));
        assert_eq!(parse_rate_arg("0"), Ok(0));
        assert_eq!(parse_rate_arg("unlimited"), Ok(0));
        assert_eq!(parse_rate_arg("fast"), Err(RATE_HINT.to_owned()));
        assert_eq!(parse_rate_arg("200MiB/min"), Err(RATE_HINT.to_owned()));
        let err = parse_rate_arg("200").unwrap_err();
        assert!(err.starts_with("200 is only 200 bytes per second"), "{err}");
        assert!(parse_rate_arg("4095").is_err());
    }

    #[test]
    fn bursts_are_whole_milliseconds_up_to_a_minute() {
        assert_eq!(parse_burst("100ms"), Ok(100));
        assert_eq!(parse_burst("2s"), Ok(2000));
        assert_eq!(parse_burst("1.5s"), Ok(1500));
        assert_eq!(parse_burst("1.250s"), Ok(1250));
        assert_eq!(parse_burst("0.02s"), Ok(20));
        assert_eq!(parse_burst("60s"), Ok(60_000));
        assert_eq!(parse_burst("60000ms"), Ok(60_000));
        assert_eq!(parse_burst("default"), Ok(0));
        assert_eq!(parse_burst("0"), Ok(0));
        assert!(parse_burst("61s").unwrap_err().contains("60s"));
        assert!(parse_burst("99999999999999999999s")
            .unwrap_err()
            .contains("60s"));
        assert!(parse_burst("1.0005s").unwrap_err().contains("whole"));
        assert!(parse_burst("0.5ms").unwrap_err().contains("whole"));
        for bad in ["100", "2m", "ms", ".5s", "1.s5", "-1s", "unlimited"] {
            assert_eq!(parse_burst(bad), Err(BURST_HINT.to_owned()), "{bad:?}");
        }
    }

    #[test]
    fn create_volume_without_limit_flags_asks_for_none() {
        let Command::Call(Call::CreateVolume(c)) =
            parse(&["create-volume", "v", "--size", "1G", "--backend", "ram"])
                .unwrap()
                .command
        else {
            panic!()
        };
        assert_eq!(c.to_request().spec.unwrap().qos, None);
    }

    #[test]
    fn create_volume_carries_the_limits_given() {
        let cli = parse(&[
            "create-volume",
            "v",
            "--size",
            "1G",
            "--backend",
            "ram",
            "--read-iops",
            "5000",
            "--write-bw",
            "200MiB/s",
            "--burst",
            "250ms",
        ])
        .unwrap();
        let Command::Call(Call::CreateVolume(c)) = cli.command else {
            panic!("parsed as {:?}", cli.command)
        };
        assert_eq!(
            c.to_request().spec.unwrap().qos,
            Some(limits(5000, 0, 0, 200 * MIB, 250))
        );
    }

    #[test]
    fn adopt_device_takes_the_limits_too() {
        let cli = parse(&[
            "adopt-device",
            "3",
            "v",
            "--backend",
            "ram",
            "--write-iops",
            "100",
            "--read-bw",
            "1Gi",
        ])
        .unwrap();
        let Command::Call(Call::AdoptDevice(a)) = cli.command else {
            panic!("parsed as {:?}", cli.command)
        };
        assert_eq!(
            a.to_request().spec.unwrap().qos,
            Some(limits(0, 100, 1 << 30, 0, 0))
        );
    }

    #[test]
    fn bad_limits_are_usage_errors() {
        let err = set_qos(&["v", "--write-bw", "200MiB/h"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains(RATE_HINT), "{err}");
        let err = set_qos(&["v", "--burst", "2min"]).unwrap_err();
        assert!(err.to_string().contains(BURST_HINT), "{err}");
    }

    #[test]
    fn set_qos_changes_only_the_limits_given() {
        let current = limits(5000, 800, 0, 100 * MIB, 250);
        let req = set_qos(&["vol-1", "--write-bw", "200MiB/s"])
            .unwrap()
            .to_request(Some(current));
        assert_eq!(req.id, "vol-1");
        assert_eq!(req.qos, Some(limits(5000, 800, 0, 200 * MIB, 250)));

        let req = set_qos(&["vol-1", "--read-iops", "unlimited", "--write-iops", "0"])
            .unwrap()
            .to_request(Some(current));
        assert_eq!(req.qos, Some(limits(0, 0, 0, 100 * MIB, 250)));

        let req = set_qos(&["vol-1", "--burst", "default"])
            .unwrap()
            .to_request(Some(current));
        assert_eq!(req.qos, Some(limits(5000, 800, 0, 100 * MIB, 0)));
    }

    #[test]
    fn set_qos_on_an_unlimited_volume_starts_from_nothing() {
        let req = set_qos(&["v", "--read-bw", "1G/s"])
            .unwrap()
            .to_request(None);
        assert_eq!(req.qos, Some(limits(0, 0, 1_000_000_000, 0, 0)));
    }

    #[test]
    fn removing_the_last_limit_sends_none() {
        let req = set_qos(&["v", "--write-bw", "unlimited"])
            .unwrap()
            .to_request(Some(limits(0, 0, 0, 100 * MIB, 0)));
        assert_eq!(req.qos, None);
    }

    #[test]
    fn clear_removes_everything_and_the_flags_given_with_it_are_the_set() {
        let current = limits(5000, 800, 3 * MIB, 100 * MIB, 250);
        let req = set_qos(&["v", "--clear"])
            .unwrap()
            .to_request(Some(current));
        assert_eq!(req.qos, None);
        let req = set_qos(&["v", "--clear", "--write-iops", "10"])
            .unwrap()
            .to_request(Some(current));
        assert_eq!(req.qos, Some(limits(0, 10, 0, 0, 0)));
    }

    #[test]
    fn set_qos_without_a_change_is_a_usage_error() {
        let err = set_qos(&["v"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("--clear"), "{err}");
        assert!(set_qos(&["--clear"]).is_err(), "the volume is required");
    }

    #[test]
    fn limits_read_as_text() {
        assert_eq!(
            limits_text(Some(&limits(5000, 0, 0, 200 * MIB, 0))),
            "read 5000 IOPS, write 200 MiB/s, burst 100 ms"
        );
        assert_eq!(
            limits_text(Some(&limits(5000, 10, 1 << 30, 0, 2000))),
            "read 5000 IOPS and 1 GiB/s, write 10 IOPS, burst 2 s"
        );
        assert_eq!(
            limits_text(Some(&limits(0, 0, 0, 1_000_000_000, 1500))),
            "write 953.7 MiB/s, burst 1500 ms"
        );
        assert_eq!(limits_text(None), "unlimited");
        assert_eq!(limits_text(Some(&QosLimits::default())), "unlimited");
        assert_eq!(
            limits_text(Some(&limits(0, 0, 0, 0, 2000))),
            "unlimited, burst 2 s"
        );
        assert_eq!(
            limits_cell(Some(&limits(5000, 0, 0, 200 * MIB, 2000))),
            "read 5000 IOPS, write 200 MiB/s"
        );
        assert_eq!(limits_cell(Some(&limits(0, 0, 0, 0, 2000))), "-");
        assert_eq!(limits_cell(None), "-");
    }

    #[test]
    fn limits_json_uses_proto_field_names() {
        assert_eq!(
            crate::api_json::value(&limits(1, 2, 3, 4, 5), "QosLimits").unwrap(),
            json!({
                "read_iops": 1,
                "write_iops": 2,
                "read_bytes_per_second": 3,
                "write_bytes_per_second": 4,
                "burst_ms": 5,
            })
        );
    }
}
