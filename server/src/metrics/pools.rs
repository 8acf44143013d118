//! The pools' capacity at scrape time: for every pool of the node (`capacity::pools`), its size
//! and the bytes new volumes can still get, counted as GetCapacity counts them, so that the
//! "pool almost full" alert and the CSIStorageCapacity objects the scheduler reads never
//! disagree.

use super::text::{family, Kind};
use crate::backend::Pool;
use crate::capacity::{pool_space, pools};
use crate::config::Settings;
use crate::volume::Volume;
use std::sync::Arc;

/// Why every pool is down while the dataplane does not run.
const NOT_SERVING: &str = "no ublk dataplane: the node offers no capacity";

/// One pool as read: `(total, free)`, or why it could not be read.
type Reading = (Pool, Result<(u64, u64), String>);

/// Reads every pool (statfs, FIEMAP and Identify block: on the blocking pool). A pool that
/// cannot be read is logged at debug and reported by `ublkd_capacity_up` 0; without a running
/// dataplane (`serving` false) no pool offers anything, as GetCapacity answers then, and every
/// one is down.
pub async fn read(settings: Arc<Settings>, volumes: Vec<Volume>, serving: bool) -> Vec<Reading> {
    let joined = tokio::task::spawn_blocking(move || {
        pools(&settings, &volumes)
            .into_iter()
            .map(|p| {
                if !serving {
                    return (p, Err(NOT_SERVING.to_owned()));
                }
                let space = pool_space(&p, &volumes, &settings).map_err(|e| e.to_string());
                if let Err(e) = &space {
                    tracing::debug!(pool = ?p, error = %e, "reading a pool's capacity failed");
                }
                (p, space)
            })
            .collect()
    })
    .await;
    match joined {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "reading the pools' capacity panicked");
            Vec::new()
        }
    }
}

/// Appends the capacity families to `out`.
pub fn write(readings: &[Reading], settings: &Settings, out: &mut String) {
    let labels = |p: &Pool| -> [(&'static str, String); 2] {
        [
            ("backend", p.kind().name().to_owned()),
            ("pool", p.place(settings).display().to_string()),
        ]
    };
    let each = |f: &mut super::text::Family<'_>, pick: fn(u64, u64) -> u64| {
        for (p, space) in readings {
            if let Ok((total, free)) = space {
                let l = labels(p);
                f.gauge(
                    &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)],
                    pick(*total, *free) as f64,
                );
            }
        }
    };
    family(
        out,
        "ublkd_capacity_bytes",
        "Size of each pool new volumes take bytes from: a file root's file system, the RAM \
         directory, an NVMe namespace (GetCapacity's total_bytes)",
        Kind::Gauge,
        |f| each(f, |total, _| total),
    );
    family(
        out,
        "ublkd_capacity_free_bytes",
        "Bytes new volumes can still get from each pool, what sparse file volumes and RAM \
         volumes may still claim held back (GetCapacity's available_bytes)",
        Kind::Gauge,
        |f| each(f, |_, free| free),
    );
    family(
        out,
        "ublkd_capacity_up",
        "1 when the pool's capacity could be read at this scrape, 0 when not (a root missing, \
         a namespace gone)",
        Kind::Gauge,
        |f| {
            for (p, space) in readings {
                let l = labels(p);
                f.gauge(
                    &[(l[0].0, &l[0].1), (l[1].0, &l[1].1)],
                    f64::from(u8::from(space.is_ok())),
                );
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pool_is_a_series_and_an_unreadable_one_is_down() {
        let settings = Settings {
            ram_dir: "/dev/shm/ublkd".into(),
            ..Default::default()
        };
        let readings = vec![
            (Pool::File("/var/lib/ublkd/volumes".into()), Ok((1000, 250))),
            (Pool::Ram, Ok((64, 64))),
            (Pool::Nvme("/dev/ng0n1".into()), Err("gone".to_owned())),
        ];
        let mut out = String::new();
        write(&readings, &settings, &mut out);
        for line in [
            "ublkd_capacity_bytes{backend=\"file\",pool=\"/var/lib/ublkd/volumes\"} 1000",
            "ublkd_capacity_free_bytes{backend=\"file\",pool=\"/var/lib/ublkd/volumes\"} 250",
            "ublkd_capacity_bytes{backend=\"ram\",pool=\"/dev/shm/ublkd\"} 64",
            "ublkd_capacity_up{backend=\"ram\",pool=\"/dev/shm/ublkd\"} 1",
            "ublkd_capacity_up{backend=\"nvme\",pool=\"/dev/ng0n1\"} 0",
            "# TYPE ublkd_capacity_free_bytes gauge",
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in\n{out}");
        }
        assert!(
            !out.contains("ublkd_capacity_bytes{backend=\"nvme\""),
            "{out}"
        );
    }

    /// Without a dataplane GetCapacity offers nothing; the capacity metrics agree: every pool
    /// is down and none shows free bytes (issue 55: they still showed the pools free and up).
    #[test]
    fn without_a_dataplane_every_pool_is_down() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let settings = Arc::new(Settings {
            ram_dir: dir.path().join("ram"),
            allowed_roots: vec![dir.path().to_owned()],
            ..Default::default()
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let up = rt.block_on(read(Arc::clone(&settings), Vec::new(), true));
        assert!(up.iter().all(|(_, r)| r.is_ok()), "{up:?}");
        let down = rt.block_on(read(Arc::clone(&settings), Vec::new(), false));
        assert_eq!(down.len(), 2, "the root and the RAM directory");
        let mut out = String::new();
        write(&down, &settings, &mut out);
        assert!(!out.contains("ublkd_capacity_free_bytes{"), "{out}");
        assert_eq!(out.matches("ublkd_capacity_up{").count(), 2, "{out}");
        assert!(
            out.lines()
                .filter(|l| l.starts_with("ublkd_capacity_up{"))
                .all(|l| l.ends_with(" 0")),
            "{out}"
        );
    }
}
