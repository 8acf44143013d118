//! The Prometheus text exposition format, written straight into one buffer: a family's header,
//! then its samples, family after family. No per-sample objects and no per-family buffers, so a
//! scrape with hundreds of volumes is a few appends per sample into memory that is reused from
//! one scrape to the next (`Pool`), never freshly faulted in.

use std::fmt::Write;
use std::sync::{Arc, Mutex};

/// The kinds of family this server writes.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Writes one family into `out`: `# HELP`, `# TYPE`, then the samples `body` adds; nothing at
/// all when it adds none.
pub fn family(
    out: &mut String,
    name: &'static str,
    help: &'static str,
    kind: Kind,
    body: impl FnOnce(&mut Family<'_>),
) {
    let start = out.len();
    // Writing to a String cannot fail (here and below).
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {}", kind.name()); // a String write: cannot fail
    let header = out.len();
    let mut f = Family {
        out,
        name,
        le: Vec::new(),
    };
    body(&mut f);
    if out.len() == header {
        out.truncate(start);
    }
}

/// The family being written.
pub struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
    /// A histogram family's `le` labels, formatted once.
    le: Vec<String>,
}

impl Family<'_> {
    /// One sample line: `name{labels,extra} value`.
    fn line(&mut self, suffix: &str, labels: &[(&str, &str)], extra: Option<(&str, &str)>, v: f64) {
        let out = &mut *self.out;
        out.push_str(self.name);
        out.push_str(suffix);
        let mut first = true;
        for (k, val) in labels.iter().copied().chain(extra) {
            out.push(if first { '{' } else { ',' });
            first = false;
            out.push_str(k);
            out.push_str("=\"");
            push_escaped(out, val);
            out.push('"');
        }
        if !first {
            out.push('}');
        }
        out.push(' ');
        push_value(out, v);
        out.push('\n');
    }

    pub fn counter(&mut self, labels: &[(&str, &str)], v: f64) {
        self.line("", labels, None, v);
    }

    pub fn gauge(&mut self, labels: &[(&str, &str)], v: f64) {
        self.line("", labels, None, v);
    }

    /// A histogram from non-cumulative `counts` (one per bound, then +Inf).
    pub fn histogram(&mut self, labels: &[(&str, &str)], bounds: &[f64], counts: &[u64], sum: f64) {
        if self.le.len() != bounds.len() {
            self.le = bounds
                .iter()
                .map(|&ub| {
                    let mut s = String::new();
                    push_value(&mut s, ub);
                    s
                })
                .collect();
        }
        let le = std::mem::take(&mut self.le);
        let mut acc = 0u64;
        for (i, bound) in le.iter().enumerate() {
            acc += counts.get(i).copied().unwrap_or(0);
            self.line("_bucket", labels, Some(("le", bound)), acc as f64);
        }
        self.le = le;
        let total = acc + counts.iter().skip(bounds.len()).sum::<u64>();
        self.line("_bucket", labels, Some(("le", "+Inf")), total as f64);
        self.line("_sum", labels, None, sum);
        self.line("_count", labels, None, total as f64);
    }
}

/// A label value, escaped as the text format wants (backslash, quote, newline).
fn push_escaped(out: &mut String, val: &str) {
    if !val.bytes().any(|b| matches!(b, b'\\' | b'"' | b'\n')) {
        out.push_str(val);
        return;
    }
    for c in val.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// A sample value as Prometheus reads it: `+Inf`, `-Inf`, `NaN`, whole numbers (most samples)
/// through integer formatting, else Rust's shortest form.
fn push_value(out: &mut String, v: f64) {
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        let _ = write!(out, "{}", v as i64); // a String write: cannot fail
    } else if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        let _ = write!(out, "{v}"); // a String write: cannot fail
    }
}

/// Scrape buffers kept for the next scrape: a response body hands its buffer back when hyper
/// drops it, so steady-state scrapes allocate nothing proportional to their size.
#[derive(Debug, Clone, Default)]
pub struct Pool {
    free: Arc<Mutex<Vec<String>>>,
}

/// More than two scrapes at once is unusual; buffers beyond these are freed.
const POOL_KEEP: usize = 2;

impl Pool {
    /// An empty buffer, with the capacity of an earlier scrape when one is free.
    pub fn take(&self) -> String {
        self.free
            .lock()
            .ok()
            .and_then(|mut f| f.pop())
            .unwrap_or_default()
    }

    /// `text` as a response body that returns its buffer here once sent.
    pub fn body(&self, text: String) -> bytes::Bytes {
        bytes::Bytes::from_owner(Pooled {
            text,
            pool: self.clone(),
        })
    }
}

struct Pooled {
    text: String,
    pool: Pool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        self.text.as_bytes()
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut text = std::mem::take(&mut self.text);
        text.clear();
        if let Ok(mut free) = self.pool.free.lock() {
            if free.len() < POOL_KEEP {
                free.push(text);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let mut out = String::new();
        family(&mut out, "ublkd_x", "An x", Kind::Gauge, |f| {
            f.gauge(&[("volume", "a\"b"), ("op", "read")], 1.5);
            f.gauge(&[("volume", "c")], 7.0);
        });
        family(&mut out, "ublkd_h_seconds", "An h", Kind::Histogram, |f| {
            f.histogram(&[("volume", "v")], &[0.5, 1.0], &[1, 2, 3], 4.25);
        });
        family(&mut out, "ublkd_none", "Nothing", Kind::Counter, |_| {});
        family(&mut out, "ublkd_inf", "Odd values", Kind::Gauge, |f| {
            f.gauge(&[], f64::INFINITY);
            f.gauge(&[], f64::NAN);
            f.gauge(&[], -3.0);
        });
        assert_eq!(
            out,
            "# HELP ublkd_x An x\n# TYPE ublkd_x gauge\n\
             ublkd_x{volume=\"a\\\"b\",op=\"read\"} 1.5\n\
             ublkd_x{volume=\"c\"} 7\n\
             # HELP ublkd_h_seconds An h\n# TYPE ublkd_h_seconds histogram\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"0.5\"} 1\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"1\"} 3\n\
             ublkd_h_seconds_bucket{volume=\"v\",le=\"+Inf\"} 6\n\
             ublkd_h_seconds_sum{volume=\"v\"} 4.25\n\
             ublkd_h_seconds_count{volume=\"v\"} 6\n\
             # HELP ublkd_inf Odd values\n# TYPE ublkd_inf gauge\n\
             ublkd_inf +Inf\nublkd_inf NaN\nublkd_inf -3\n"
        );
    }

    #[test]
    fn a_sent_body_gives_its_buffer_back() {
        let pool = Pool::default();
        let mut text = pool.take();
        text.push_str(&"x".repeat(100_000));
        let cap = text.capacity();
        let body = pool.body(text);
        assert_eq!(body.len(), 100_000);
        drop(body);
        let again = pool.take();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), cap, "the same buffer, reused");
    }
}
