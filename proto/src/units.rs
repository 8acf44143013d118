//! Human-readable sizes for the API's users: `4096`, `512Ki`, `10GiB`, `10G`, `1.5T` in,
//! `10 GiB` out. Suffixes read as Kubernetes quantities do: `Ki`/`KiB`, `Mi`, `Gi`, `Ti`, `Pi`,
//! `Ei` are binary (2^10 steps); `k`/`K`/`KB`, `M`, `G`, `T`, `P`, `E` are decimal (10^3 steps).
//! A lone lowercase `m` is refused: Kubernetes reads it as milli. Shared by `ublkctl` and the
//! daemon's command line so both read sizes the same way.

/// Parses a size; `None` for anything that is not a non-negative size that fits in a u64.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit = unit.trim();
    if unit == "m" {
        return None;
    }
    let lower = unit.to_ascii_lowercase();
    let (prefix, binary) = match lower.strip_suffix("ib").or_else(|| lower.strip_suffix('i')) {
        Some(p) => (p, true),
        None => (lower.strip_suffix('b').unwrap_or(&lower), false),
    };
    let step = ["", "k", "m", "g", "t", "p", "e"]
        .iter()
        .position(|&u| u == prefix)?;
    if step == 0 && binary {
        return None; // "i" or "iB" alone
    }
    let base: u64 = if binary { 1024 } else { 1000 };
    let mult = base.checked_pow(step as u32)?;
    if num.contains('.') {
        let v: f64 = num.parse().ok()?;
        let bytes = v * mult as f64;
        (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64 && bytes.fract() == 0.0)
            .then_some(bytes as u64)
    } else {
        num.parse::<u64>().ok()?.checked_mul(mult)
    }
}

/// Parses a rate in bytes per second: a size as [`parse_size`] reads it, optionally followed by
/// `/s` (`200MiB/s`, `200Mi`, `1G/s`).
pub fn parse_rate(s: &str) -> Option<u64> {
    let s = s.trim();
    parse_size(s.strip_suffix("/s").unwrap_or(s))
}

/// A size as short as it can be written exactly, with no space (`1GiB`, `512KiB`), else its
/// bytes (`4097`): what a notation that is parsed back needs.
pub fn compact_size(bytes: u64) -> String {
    let text = format_size(bytes);
    if text.contains('.') {
        bytes.to_string()
    } else {
        text.replace(' ', "")
    }
}

/// Formats `bytes` with the largest binary unit that divides it exactly, else one decimal.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut exact = bytes;
    while unit + 1 < UNITS.len() && exact >= 1024 && exact % 1024 == 0 {
        exact /= 1024;
        unit += 1;
    }
    if exact < 1024 || unit + 1 == UNITS.len() {
        return format!("{exact} {}", UNITS[unit]);
    }
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units_as_kubernetes_does() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("4096B"), Some(4096));
        assert_eq!(parse_size("512Ki"), Some(512 << 10));
        assert_eq!(parse_size("10Gi"), Some(10 << 30));
        assert_eq!(parse_size("10GiB"), Some(10 << 30));
        assert_eq!(parse_size("1.5Gi"), Some(3 << 29));
        assert_eq!(parse_size(" 2 MiB "), Some(2 << 20));
        assert_eq!(parse_size("1Ei"), Some(1 << 60));
        assert_eq!(parse_size("10G"), Some(10_000_000_000));
        assert_eq!(parse_size("10GB"), Some(10_000_000_000));
        assert_eq!(parse_size("512k"), Some(512_000));
        assert_eq!(parse_size("512K"), Some(512_000));
        assert_eq!(parse_size("3M"), Some(3_000_000));
        assert_eq!(parse_size("1.5T"), Some(1_500_000_000_000));
        assert_eq!(parse_size("2E"), Some(2_000_000_000_000_000_000));
    }

    #[test]
    fn formats_exact_and_fractional_sizes() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(10 << 30), "10 GiB");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(format_size(4096 + 1), "4.0 KiB");
        assert_eq!(
            parse_size(&format_size(3 << 40).replace(' ', "")),
            Some(3 << 40)
        );
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("ten"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size("5X"), None);
        assert_eq!(parse_size("99999999999P"), None);
        assert_eq!(parse_size("1.3"), None, "fractions of a byte");
        assert_eq!(
            parse_size("10m"),
            None,
            "milli in Kubernetes: refused, not guessed"
        );
        assert_eq!(parse_size("5i"), None);
        assert_eq!(parse_size("5iB"), None);
        assert_eq!(parse_size("20Ei"), None, "over u64");
    }

    #[test]
    fn reads_rates_with_or_without_per_second() {
        assert_eq!(parse_rate("200MiB/s"), Some(200 << 20));
        assert_eq!(parse_rate("200Mi"), Some(200 << 20));
        assert_eq!(parse_rate("1G/s"), Some(1_000_000_000));
        assert_eq!(parse_rate("fast/s"), None);
    }
}
