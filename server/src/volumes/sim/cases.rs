//! Histories written by hand, one per defect the seeded search must keep finding: each sets up
//! the state the defect needs and checks what its fix promises (issue and review item named in
//! each test's doc).

use super::kernel::{self, Call, SimKernel, CHUNK, NS_BYTES, NS_PATH, NS_PATHS};
use super::{base_record, on_disk, sid, vid, volumes, volumes_limited, Dirs};
use crate::backend::BackendRecord;
use crate::simctx;
use crate::volume::State;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use ublkd_dataplane::DevId;

/// Runs `f` as one history: the simulator's runtime (one thread, virtual time) and context on,
/// a fresh kernel and directories.
fn one_history<F, Fut>(f: F)
where
    F: FnOnce(Arc<SimKernel>, Arc<Dirs>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let dirs = Arc::new(Dirs::new());
    let kernel = Arc::new(SimKernel::new(&dirs.state, 1));
    simctx::set_on(true);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
        .block_on(f(kernel, dirs));
    simctx::set_on(false);
}

/// A window of `length` bytes at `offset` of the namespace named `path`, erased when new.
fn nvme(path: &str, offset: u64, length: u64) -> BackendRecord {
    BackendRecord::Nvme {
        device: PathBuf::from(path),
        offset,
        length,
        keep_data: false,
        identity: None,
    }
}

/// A window that does not fit its namespace (a length near u64::MAX that would wrap, past the
/// end, smaller than the volume) is refused before anything is recorded or asked of the kernel
/// (issue 38, defect 6); one that fits is made.
#[test]
fn a_window_that_does_not_fit_its_namespace_is_refused_before_it_is_recorded() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let nvme = |offset, length| nvme(NS_PATH, offset, length);
        for (offset, length) in [
            (0, u64::MAX),
            (4 * CHUNK, u64::MAX - 2 * CHUNK),
            (4 * CHUNK, u64::MAX - 4 * CHUNK + 1),
            (NS_BYTES - CHUNK, 2 * CHUNK),
            (NS_BYTES, 0),
            (0, CHUNK),
        ] {
            let record = base_record(vid("w"), 2 * CHUNK, nvme(offset, length));
            let refused = v.create(record, false).await;
            assert!(
                matches!(
                    refused,
                    Err(crate::error::VolumeError::AdmitWindowPastEnd { .. })
                ),
                "window {offset}+{length}: {refused:?}"
            );
            assert!(
                on_disk(&dirs.state).is_empty(),
                "window {offset}+{length} was recorded"
            );
        }
        assert!(kernel.world().calls.is_empty(), "the kernel was asked");
        let fits = base_record(vid("w"), 2 * CHUNK, nvme(NS_BYTES - 2 * CHUNK, 0));
        let made = v.create(fits, false).await;
        assert!(made.is_ok(), "{made:?}");
    });
}

/// An orphan device adopted as a volume passes the same checks as a create (the lower list of
/// issue 38): it may not take another record's backing file or overlap its NVMe window.
#[test]
fn an_adopted_device_takes_no_other_volumes_file_or_window() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let file = BackendRecord::File {
            path: dirs.files.join("f1.img"),
            create: true,
        };
        let nvme = |offset| nvme(NS_PATH, offset, 4 * CHUNK);
        for record in [
            base_record(vid("a"), 4 * CHUNK, file.clone()),
            base_record(vid("n"), 4 * CHUNK, nvme(0)),
            base_record(vid("o"), 4 * CHUNK, BackendRecord::Null),
        ] {
            let made = v.create(record, false).await;
            assert!(made.is_ok(), "{made:?}");
        }
        // o's device becomes an orphan: its record goes, the device stays.
        let o = v.get(&vid("o")).await.unwrap_or_else(|e| panic!("{e}"));
        let dev = o.record.dev_id.unwrap_or(DevId(u32::MAX));
        kernel.orphan(dev);
        v.store
            .registry()
            .remove("o")
            .unwrap_or_else(|e| panic!("{e}"));
        v.table.lock().await.remove(&vid("o"));
        let taken = v.adopt(dev, base_record(vid("b"), 4 * CHUNK, file)).await;
        assert!(
            matches!(
                taken,
                Err(crate::error::VolumeError::AdmitBackingInUse { .. })
            ),
            "{taken:?}"
        );
        let overlapping = v
            .adopt(dev, base_record(vid("c"), 4 * CHUNK, nvme(2 * CHUNK)))
            .await;
        assert!(
            matches!(
                overlapping,
                Err(crate::error::VolumeError::AdmitWindowOverlap { .. })
            ),
            "{overlapping:?}"
        );
        let fine = v
            .adopt(dev, base_record(vid("d"), 0, BackendRecord::Null))
            .await;
        assert!(fine.is_ok(), "{fine:?}");
    });
}

/// A placed window whose length is near u64::MAX, past the namespace or below the volume's
/// size is refused before anything is erased, and a READY neighbour keeps every block (issue
/// 55, review H1: the rounded length wrapped to 0, "to the end", and the new window's erase
/// ran over every window above it).
#[test]
fn a_placed_window_with_a_huge_length_erases_no_neighbour() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let nvme = |offset, length| nvme(NS_PATH, offset, length);
        let a = base_record(vid("a"), 4 * CHUNK, nvme(16 * CHUNK, 4 * CHUNK));
        assert!(v.create(a, false).await.is_ok());
        let erases = || {
            kernel
                .world()
                .calls
                .get(&(Call::EraseWindow, false))
                .copied()
        };
        let after_a = erases();
        for length in [u64::MAX, u64::MAX - CHUNK + 1, NS_BYTES + CHUNK, CHUNK] {
            let p = base_record(vid("p"), 2 * CHUNK, nvme(0, length));
            let refused = v.create(p, true).await;
            assert!(
                matches!(
                    refused,
                    Err(crate::error::VolumeError::AdmitWindowPastEnd { .. })
                ),
                "placed +{length}: {refused:?}"
            );
            let lost = std::mem::take(&mut kernel.world().violations);
            assert!(lost.is_empty(), "placed +{length}: {lost:?}");
        }
        assert_eq!(erases(), after_a, "nothing but a's own window was erased");
    });
}

/// A resize is admitted as a create is (issue 55, review M2): a RAM volume grown past ublkd's
/// memory limit and a file volume grown past its file system's free space are refused, and
/// nothing grows; a growth that fits is made.
#[test]
fn a_resize_past_the_memory_limit_or_the_free_space_is_refused() {
    use crate::error::VolumeError;
    one_history(|kernel, dirs| async move {
        let path = dirs.files.join("f.img");
        let file = base_record(
            vid("f"),
            CHUNK,
            BackendRecord::File {
                path: path.clone(),
                create: true,
            },
        );
        let small = base_record(vid("r"), 4 * CHUNK, BackendRecord::Ram);
        // Room for both volumes and 4 MiB more: not for a RAM volume of 40 MiB.
        let limit = crate::capacity::MEMORY_RESERVE
            + crate::capacity::memory_bytes(&file)
            + crate::capacity::memory_bytes(&small)
            + 4 * CHUNK;
        let v = volumes_limited(&dirs.state, &kernel, Some(limit));
        assert!(v.create(file, false).await.is_ok());
        assert!(v.create(small, false).await.is_ok());
        let big = base_record(vid("b"), 40 * CHUNK, BackendRecord::Ram);
        let refused = v.create(big, false).await;
        assert!(
            matches!(refused, Err(VolumeError::AdmitMemoryLimit { .. })),
            "create: {refused:?}"
        );
        let grown = v.resize(&vid("r"), 40 * CHUNK).await;
        assert!(
            matches!(grown, Err(VolumeError::AdmitMemoryLimit { .. })),
            "resize: {grown:?}"
        );
        let r = v.get(&vid("r")).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            r.record.size_bytes,
            4 * CHUNK,
            "the refused size is not kept"
        );
        let fits = v.resize(&vid("r"), 8 * CHUNK).await;
        assert!(fits.is_ok(), "a growth within the limit: {fits:?}");

        let (avail, _) = ublkd_dataplane::fs_space(&dirs.files).unwrap_or_else(|e| panic!("{e}"));
        let past = (avail + 64 * CHUNK).next_multiple_of(4096);
        let grown = v.resize(&vid("f"), past).await;
        assert!(
            matches!(grown, Err(VolumeError::AdmitFileSpace { .. })),
            "file resize past {avail} free bytes: {grown:?}"
        );
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert_eq!(len, CHUNK, "the backing file was not grown");
        let f = v.get(&vid("f")).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.record.size_bytes, CHUNK, "the refused size is not kept");
    });
}

/// A reboot that swaps two namespaces' names brings each NVMe volume back on its own namespace,
/// found by the identity its record keeps; a volume whose namespace is not found at all is
/// FAILED and nothing is erased (issue 55, review H2: restore, erase and delete trusted
/// `/dev/ngXnY`, which follows probe order).
#[test]
fn a_reboot_that_swaps_nvme_names_serves_each_volume_from_its_own_namespace() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        for (id, path, at) in [
            ("a", NS_PATHS[0], 0),
            ("b", NS_PATHS[1], 0),
            ("c", NS_PATHS[1], 8 * CHUNK),
        ] {
            let record = base_record(vid(id), 4 * CHUNK, nvme(path, at, 4 * CHUNK));
            let made = v.create(record, false).await;
            let identity = match made.as_ref().map(|m| &m.record.backend) {
                Ok(BackendRecord::Nvme { identity, .. }) => identity.clone(),
                other => panic!("{id}: {other:?}"),
            };
            assert_eq!(identity, Some(kernel::ns_identity(usize::from(id != "a"))));
        }
        // c's namespace leaves the node: its record names an identity no namespace has.
        let mut c = on_disk(&dirs.state).remove(2);
        if let BackendRecord::Nvme { identity, .. } = &mut c.backend {
            *identity = Some(ublkd_dataplane::NamespaceIdentity::Eui64([0xff; 8]));
        }
        v.store.registry().put(&c).unwrap_or_else(|e| panic!("{e}"));
        kernel.reboot(true);
        kernel.world().calls.clear();
        let v = volumes(&dirs.state, &kernel);
        v.load().await.unwrap_or_else(|e| panic!("{e}"));
        v.restore().await;
        let violations = std::mem::take(&mut kernel.world().violations);
        assert!(violations.is_empty(), "{violations:?}");
        for (id, now) in [("a", NS_PATHS[1]), ("b", NS_PATHS[0])] {
            let vol = v.get(&vid(id)).await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(vol.state, State::Ready, "{id}: {}", vol.message);
            assert!(
                matches!(&vol.record.backend, BackendRecord::Nvme { device, .. } if device == Path::new(now)),
                "{id} is served from its namespace's new name: {:?}",
                vol.record.backend
            );
        }
        let c = v.get(&vid("c")).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.state, State::Failed);
        assert!(c.message.contains("eui.ffffffffffffffff"), "{}", c.message);
        assert_eq!(
            kernel.world().calls.get(&(Call::EraseWindow, false)),
            None,
            "a restore erases nothing"
        );
    });
}

/// A volume record that cannot be read stops the start, naming the file, and stays where it is:
/// moved aside, it took its volume's claims with it, and the next placed create erased the
/// volume's window (issue 55, review M3).
#[test]
fn an_unreadable_record_stops_the_start_and_keeps_its_claims() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let nvme = nvme(NS_PATH, 0, 4 * CHUNK);
        let made = v
            .create(base_record(vid("a"), 4 * CHUNK, nvme), false)
            .await;
        assert!(made.is_ok(), "{made:?}");
        let path = dirs.state.join("registry/a.json");
        std::fs::write(&path, b"{\"id\":\"a\",\"size_b").unwrap_or_else(|e| panic!("{e}"));
        kernel.process_died();
        let v = volumes(&dirs.state, &kernel);
        let loaded = v.load().await;
        assert!(
            matches!(
                &loaded,
                Err(crate::error::VolumeError::Registry(
                    crate::registry::RegistryError::Unreadable { path: p, .. }
                )) if *p == path
            ),
            "{loaded:?}"
        );
        assert!(path.exists(), "the record stays where it is");
        // ublkd exits on this error (`main`: the load comes before the API): no create can
        // place a window over a's.
    });
}

/// A restart under a memory limit lower than its records need brings up what fits and leaves
/// the rest FAILED with the reason (issue 55, review L3: the restore admitted nothing, and ublkd
/// was OOM-killed while restoring, in a loop).
#[test]
fn a_restore_past_the_memory_limit_fails_the_volumes_that_do_not_fit() {
    let ram = |id| base_record(vid(id), 4 * CHUNK, BackendRecord::Ram);
    let one = crate::capacity::memory_bytes(&ram("a"));
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        for id in ["a", "b", "c"] {
            assert!(v.create(ram(id), false).await.is_ok());
        }
        kernel.reboot(false);
        let limit = crate::capacity::MEMORY_RESERVE + 2 * one;
        let v = volumes_limited(&dirs.state, &kernel, Some(limit));
        v.load().await.unwrap_or_else(|e| panic!("{e}"));
        let failed = v.restore().await;
        assert_eq!(failed, vec![vid("c")]);
        for id in ["a", "b"] {
            let vol = v.get(&vid(id)).await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(vol.state, State::Ready, "{id}: {}", vol.message);
        }
        let c = v.get(&vid("c")).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.state, State::Failed);
        assert!(c.message.contains("memory limit"), "{}", c.message);
        assert_eq!(kernel.devices().len(), 2, "c was not made");
    });
}

/// The restore finishes a pending erase unless the surviving device is the record's by every
/// parameter it shows: another server's device that only has the recorded id and a large size
/// proves nothing (issue 55, review L9).
#[test]
fn a_pending_erase_is_not_skipped_for_a_device_that_is_not_the_records() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let nvme = nvme(NS_PATH, 0, 4 * CHUNK);
        let made = v
            .create(base_record(vid("a"), 4 * CHUNK, nvme), false)
            .await;
        let dev = made.as_ref().ok().and_then(|m| m.record.dev_id);
        let dev = dev.unwrap_or_else(|| panic!("{made:?}"));
        // A crash before the erase was recorded done, and a reboot; then another server's
        // device of 8 MiB (its own queues and depth) takes the recorded id.
        let mut a = on_disk(&dirs.state).remove(0);
        a.erase_pending = Some(crate::record::EraseRange {
            from: 0,
            to: 4 * CHUNK,
        });
        v.store.registry().put(&a).unwrap_or_else(|e| panic!("{e}"));
        kernel.reboot(false);
        assert!(kernel.foreign(dev, 8 * CHUNK));
        let before = kernel
            .world()
            .calls
            .get(&(Call::EraseWindow, false))
            .copied();
        let v = volumes(&dirs.state, &kernel);
        v.load().await.unwrap_or_else(|e| panic!("{e}"));
        v.restore().await;
        let after = kernel
            .world()
            .calls
            .get(&(Call::EraseWindow, false))
            .copied();
        assert!(
            after > before,
            "the pending erase was skipped: {before:?} -> {after:?}"
        );
    });
}

/// A file intent left behind (its removal failed after the create) does not make the next start
/// remove a file a later delete kept (issue 55, review L6).
#[test]
fn a_stale_file_intent_never_removes_a_kept_file() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let path = dirs.files.join("kept.img");
        let file = BackendRecord::File {
            path: path.clone(),
            create: true,
        };
        assert!(v
            .create(base_record(vid("f"), CHUNK, file), false)
            .await
            .is_ok());
        // The create's intent, as a failed removal leaves it.
        let stale = crate::snapshot::FileIntent {
            id: vid("f"),
            path: path.clone(),
        };
        v.snaps
            .intents
            .put(&stale)
            .unwrap_or_else(|e| panic!("{e}"));
        let deleted = v.delete(&vid("f"), false, false, false).await;
        assert!(deleted.is_ok(), "{deleted:?}");
        assert!(path.exists(), "the delete keeps the file");
        let v = volumes(&dirs.state, &kernel);
        v.load().await.unwrap_or_else(|e| panic!("{e}"));
        assert!(path.exists(), "the next start removed the kept file");
    });
}

/// A snapshot copy no record names (its snapshot died before the record) is removed at the next
/// start; a recorded snapshot's copy stays (issue 55, review L12).
#[test]
fn a_stray_snapshot_copy_is_removed_at_start() {
    one_history(|kernel, dirs| async move {
        let v = volumes(&dirs.state, &kernel);
        let file = BackendRecord::File {
            path: dirs.files.join("f.img"),
            create: true,
        };
        assert!(v
            .create(base_record(vid("f"), CHUNK, file), false)
            .await
            .is_ok());
        let kept = v.create_snapshot(sid("s1"), vid("f")).await;
        let kept = kept.unwrap_or_else(|e| panic!("{e}")).path;
        let stray = dirs
            .files
            .join(crate::snapshot::SNAPSHOT_DIR)
            .join("s2.img");
        std::fs::write(&stray, b"a copy whose record was never written")
            .unwrap_or_else(|e| panic!("{e}"));
        let v = volumes(&dirs.state, &kernel);
        v.load().await.unwrap_or_else(|e| panic!("{e}"));
        assert!(!stray.exists(), "the stray copy is removed");
        assert!(kept.exists(), "the recorded snapshot's copy stays");
    });
}
