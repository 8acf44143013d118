//! Human-readable sizes: `4096`, `512K`, `10GiB`, `1.5T`. Binary units (K = KiB = 1024).

/// Parses a size; `None` for anything that is not a non-negative size that fits in a u64.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        _ => return None,
    };
    if num.contains('.') {
        let v: f64 = num.parse().ok()?;
        let bytes = v * mult as f64;
        (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64 && bytes.fract() == 0.0)
            .then_some(bytes as u64)
    } else {
        num.parse::<u64>().ok()?.checked_mul(mult)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_binary_units() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("10GiB"), Some(10 << 30));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        assert_eq!(parse_size(" 2 MiB "), Some(2 << 20));
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("ten"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size("5X"), None);
        assert_eq!(parse_size("99999999999P"), None);
        assert_eq!(parse_size("1.3"), None, "fractions of a byte");
    }
}
